"""One GPU: Qwen2.5-1.5B-Instruct on terminal tasks, the paper's ES settings, on a single H100.

  python -m jaxes.train --config=configs/gpu1.py --workdir=runs/gpu1 \
      --config.model.path=/models/Qwen2.5-1.5B-Instruct      [configs/gpu1.py:sync, :delay4, ...]

The paper's variants (configs/paper.py: sync, async1, delay4, ...; default async1) at a size one
80 GB GPU holds: bfloat16 weights (3.1 GB; two live versions under Async-1), 128 slots of 8192
tokens (the KV cache, 28 KiB per token: 28 GiB), the whole model on one device
(``mesh.target = "1xH100"``). Checked without a GPU, by the real GPU compiler:

  python -m jaxes.preflight --config=configs/gpu1.py      (mesh.target: --topology=1xH100)

(benchmarks/RESULTS.md, "Issue 57"). For Qwen2.5-0.5B-Instruct: ``--config.model.path=`` its
directory (the checkpoint decides the shape; the preset only names what to expect).
"""
from jaxes.experiments.variants import apply_es_variant
from jaxes.train.defaults import base_config

VARIANTS = ("sync", "async1", "delay4", "delay8", "allstale", "async1_weight",
            "async1_baseline_only", "async1_pace", "async2_throttle", "coevolve", "async1_switch")


def get_config(variant: str = "async1"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/gpu1.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  c = base_config()
  c.model.preset = "qwen2.5-1.5b"
  c.model.path = ""                  # required: a local Qwen2.5-1.5B-Instruct (or 0.5B) directory
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "bfloat16"
  c.tokenizer.path = ""              # empty = the tokenizer in model.path
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  c.mesh.target = "1xH100"

  c.es.mode = "lowrank"
  c.es.population = 30
  c.es.sigma = 1e-3
  c.es.learning_rate = 5e-4
  c.es.shaping = "zscore"

  c.env.sandbox = "docker"
  c.env.num_train_tasks = 2000
  c.env.num_heldout_tasks = 100
  c.env.max_turns = 16
  c.env.sandbox_workers = 32
  c.controller.episodes_per_member = 4

  c.rollout.num_slots = 128
  c.rollout.max_len = 8192
  c.rollout.prefill_chunk = 512
  c.rollout.max_new_tokens = 1024
  c.rollout.temperature = 0.0

  c.train.num_updates = 200
  c.train.eval_every = 20
  c.train.checkpoint_every = 10
  c.eval.num_tasks = 100
  c.eval.seeds = 1
  return apply_es_variant(c, variant)

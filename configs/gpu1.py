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
import os

from jaxes.train.config import load_config_file

# configs/paper.py's ES variants; its GRPO and SAO rows are sized for eight devices.
VARIANTS = ("sync", "async1", "delay4", "delay8", "allstale", "async1_weight",
            "async1_baseline_only", "async1_pace", "async2_throttle", "coevolve", "async1_switch")


def get_config(variant: str = "async1"):
  """configs/paper.py's variant (its model, ES, task and decoding settings), resized for one GPU."""
  if variant not in VARIANTS:
    raise ValueError(f"configs/gpu1.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper.py"),
                       f"{variant},8xH100")
  c.model.preset = "qwen2.5-1.5b"
  c.model.path = ""                  # required: a local Qwen2.5-1.5B-Instruct (or 0.5B) directory
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  c.mesh.target = "1xH100"
  c.env.sandbox_workers = 32
  c.controller.episodes_per_member = 4
  c.rollout.num_slots = 128
  c.rollout.max_len = 8192
  c.eval.seeds = 1
  return c

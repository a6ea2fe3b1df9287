"""The paper's grid for Qwen2.5-7B-Instruct on terminal tasks, one variant per argument:

  python -m jaxes.train --config=configs/paper.py:sync     --workdir=runs/sync \
      --config.model.path=/models/Qwen2.5-7B-Instruct

Variants: sync (synchronous ES), async1 (natural asynchrony, staleness <= 1), delay4 / delay8
(10% of each update cohort held back 4 / 8 updates on top of Async-1), allstale (stress test:
every result in a cohort is stale), async1_weight / async1_baseline_only / async1_pace (Async-1
under a stale-result policy, docs/controller.md), async2_throttle (staleness <= 2, work issued
one update ahead and stragglers waited for: tinker's slow issuing), coevolve (Async-1 with the system prompt
co-evolved alongside the parameters, Agentic ESOpt), async1_switch (Async-1 whose episodes'
later turns decode under the newest weights, PipelineRL's in-flight update), async1_pairs (Async-1
whose results wait, within the bound, for their antithetic partner). ES hyperparameters follow Qiu et al. (population 30,
sigma 1e-3, alpha 5e-4, greedy decoding, z-score shaping); the model path, the mesh and the
sandbox backend are overridable (`--config.mesh.fsdp=8`, `--config.env.sandbox=local`).

Every variant names the devices it is sized for: `configs/paper.py:async1,v5p-64` (default
8xH100: 8 x H100 80GB). `TARGETS` holds each target's mesh, chosen with

  python -m jaxes.preflight --config=configs/paper.py:async1,v5p-64 --topology=v5p-64

(`--topology` defaults to the config's `mesh.target`; numbers in benchmarks/RESULTS.md). Slots go
over `data` (the KV cache, 240 x 16384 tokens = 210 GiB in bf16, dominates), the model over
`tensor` (Qwen2.5-7B has 4 KV heads, so at most tensor=4 also splits the cache).

`configs/paper.py:sao[,TARGET]` (and `sao_delay4`, `sao_delay8`) is the SAO row (`sao()`), its
preflight sizing the policy, the value head and both optimizers' states.

`configs/paper.py:grpo[,TARGET]` is the paper's GRPO row: the same model, tasks, engine and
evaluation, trained by `jaxes.rl` (GRPO) instead of ES; its preflight reports GRPO's per-device
memory beside ES's on the same mesh. With the learner's per-layer remat, blockwise causal
attention, chunked log-probs and its float32 state split over data it needs 61.4 GiB per device
on 8xH100 (82.5%) and 72.5 GiB on 8xH200 (55.2%), CPU-compile estimates: both fit under the 90%
headroom (benchmarks/RESULTS.md, "GRPO at 7B" and "Preflight on the GPU compiler").
"""
from jaxes.experiments.variants import apply_es_variant
from jaxes.rl.config import default_config as grpo_defaults
from jaxes.train.defaults import base_config

VARIANTS = ("sync", "async1", "delay4", "delay8", "allstale", "async1_weight",
            "async1_baseline_only", "async1_pace", "async2_throttle", "coevolve", "async1_switch",
            "async1_pairs", "grpo", "sao", "sao_delay4", "sao_delay8")
# SAO's variants: the SAO row under an ES variant's controller (Async-1, its delays).
SAO_VARIANTS = {"sao": "async1", "sao_delay4": "delay4", "sao_delay8": "delay8"}
# target -> (data, fsdp, tensor); data x tensor = 8 and more shard the cache 8 ways or more.
TARGETS = {
  "8xH100": (2, 1, 4),
  "8xH200": (4, 1, 2),
  "v5p-8": (1, 1, 4),
  "v5p-64": (8, 1, 4),
}


def get_config(arg: str = "async1"):
  variant, _, target = arg.partition(",")
  target = target or "8xH100"
  if variant not in VARIANTS:
    raise ValueError(f"configs/paper.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  if target not in TARGETS:
    raise ValueError(f"configs/paper.py: unknown target {target!r}; choose one of {sorted(TARGETS)}")
  c = base_config()
  c.model.preset = "qwen2.5-7b"
  c.model.path = ""                  # required: a local Qwen2.5-7B-Instruct directory
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "bfloat16"
  c.tokenizer.path = ""              # empty = the tokenizer in model.path
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = TARGETS[target]
  c.mesh.target = target

  c.es.mode = "lowrank"
  c.es.population = 30
  c.es.sigma = 1e-3
  c.es.learning_rate = 5e-4
  c.es.shaping = "zscore"

  c.env.sandbox = "docker"
  c.env.num_train_tasks = 2000
  c.env.num_heldout_tasks = 100
  c.env.max_turns = 16
  c.env.sandbox_workers = 64
  c.controller.episodes_per_member = 8

  c.rollout.num_slots = 240
  c.rollout.max_len = 16384
  c.rollout.prefill_chunk = 512
  c.rollout.max_new_tokens = 1024
  c.rollout.temperature = 0.0
  if target.startswith("v5p"):
    # TPU: a paged cache, which the engine keeps in ragged_paged_attention's layout there, so
    # attention is the Pallas kernel, reading each row's pages up to its length (1.05x the live
    # KV per decode step at these shapes, blockwise over the unpaged cache 1.89x by its gathers:
    # benchmarks/RESULTS.md, issue 29). Pages of 128 tokens: the kernel prefetches every
    # sequence's page table into 1 MiB of SMEM (542 tokens per shard x 128 pages here; pages of
    # 16 do not fit). The pool reserves every slot's whole row (as the dense cache would, 6.6 GiB
    # per v5p-64 device), so no turn is ever cut short for a page; memory in use is the tokens
    # held. GPU targets stay unpaged: there the unpaged cache gets cuDNN attention, paged reads
    # are blockwise.
    c.rollout.page_size = 128
    c.rollout.num_pages = c.rollout.num_slots * c.rollout.max_len // c.rollout.page_size

  c.train.num_updates = 200
  c.train.eval_every = 20
  # A full checkpoint (15-30 GB at 7B) every 10 updates; every update in between is a few-KB
  # update-log record that a resume replays.
  c.train.checkpoint_every = 10
  c.eval.num_tasks = 100
  c.eval.seeds = 3

  if variant == "grpo":
    return grpo(c)
  if variant in SAO_VARIANTS:
    return apply_es_variant(sao(c), SAO_VARIANTS[variant])
  return apply_es_variant(c, variant)


def grpo(c):
  """The paper config as the GRPO baseline. Where Endless Terminals published a setting for
  Qwen2.5-7B-Instruct it is used: its SkyRL PPO config train/confs/base_qwen.yaml (upstream
  kanishkg/endless-terminals lists it in its README; read here from the copy in the public fork
  SachinKonan/endless-terminals, commit b08132a), cited below as "ET". That run is PPO with a
  critic (GAE); the GRPO-specific choices are marked as ours."""
  c.train.algorithm = "grpo"
  c.controller.mode = "sync"         # on-policy, as ET (an async GRPO row: controller.max_staleness)
  c.controller.max_staleness = 0
  c.rollout.temperature = 0.6        # ET sampling_params.temperature
  c.rollout.top_p = 1.0              # ET sampling_params.top_p
  # rollout.max_len 16384 = ET max_input_length; max_new_tokens stays the ES rows' 1024 (ET: 2048)
  # so both rows decode under the same per-turn budget; eval is the ES rows' (greedy, 100 x 3).
  g = grpo_defaults()
  g.group_size = 16                  # ET n_samples_per_prompt
  g.tasks_per_update = 16            # ET train_batch_size (prompts per batch; mini-batch = batch)
  g.updates_per_batch = 2            # ET update_epochs_per_batch
  g.seq_len = 0                      # = rollout.max_len (ET max_input_length 16384)
  g.learning_rate = 5e-7             # ET policy optimizer lr
  g.warmup_steps = 20                # ET num_warmup_steps
  g.weight_decay = 0.01              # ET weight_decay
  g.max_grad_norm = 0.1              # ET max_grad_norm
  g.clip_eps_low = 0.2               # ET eps_clip_low
  g.clip_eps_high = 0.28             # ET eps_clip_high
  g.kl_coef = 0.0                    # ET use_kl_loss: false (its kl_loss_coef 0.001 is unused)
  g.aggregation = "sequence"         # ET loss_reduction: sequence_mean
  g.advantage = "zscore"             # not published (ET uses GAE); our choice: GRPO's group z-score
  g.advantage_eps = 1e-6             # not published; our choice
  g.adam_b1, g.adam_b2, g.adam_eps = 0.9, 0.999, 1e-8  # not published; our choice (AdamW defaults)
  g.master_weights = True            # not published; our choice (float32 master + moments, bf16 policy)
  # ET trains one episode per GPU per micro-batch (micro_train_batch_size_per_gpu 1): here one
  # episode row per data shard per micro-batch.
  g.micro_batches = g.group_size * g.tasks_per_update // c.mesh.data
  c.grpo = g
  return c


def sao(c):
  """The paper config as the SAO row (arXiv 2607.07508): the GRPO row's policy learner where it
  applies (ET's lr, warm-up, weight decay, grad-norm clip and 0.2 / 0.28 clip range, now strict on
  both sides) at the GRPO row's 256 episodes per update, one per task, asynchronous (Async-1's
  controller; SAO's point). Not published for this setting, our choices: one learner step per
  batch, the token-level mean, the value head's Adam lr 1e-2 and 10 value-only warm-up updates."""
  from jaxes.rl.config import sao_default_config
  c.train.algorithm = "sao"
  c.rollout.temperature = 0.6        # ET sampling_params.temperature, as the GRPO row
  c.rollout.top_p = 1.0
  s = sao_default_config()
  s.tasks_per_update = 256           # the GRPO row's 16 x 16 episodes, one per task
  s.updates_per_batch = 1
  s.seq_len = 0
  s.learning_rate = 5e-7             # ET policy optimizer lr
  s.warmup_steps = 20                # ET num_warmup_steps
  s.weight_decay = 0.01              # ET weight_decay
  s.max_grad_norm = 0.1              # ET max_grad_norm
  s.clip_eps_low = 0.2               # ET eps_clip_low
  s.clip_eps_high = 0.28             # ET eps_clip_high
  s.aggregation = "token"
  s.master_weights = True
  s.value_learning_rate = 1e-2      # the head's steps move V by ~lr (features / d): rewards are 0..1
  s.value_warmup_updates = 10
  s.turn_values = True
  s.micro_batches = s.tasks_per_update // c.mesh.data   # one episode row per data shard, as GRPO's
  c.sao = s
  return c

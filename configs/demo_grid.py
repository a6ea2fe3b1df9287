"""The paper's grid at toy scale: configs/demo.py's setting (tiny policy, format-learning warm
start, generated tasks, local sandboxes) with one variant per argument, sized so the whole grid
(5 ES variants x 3 seeds) fits about 90 minutes on a 2-core CPU.

  python -m jaxes.experiments.grid --config=configs/demo_grid.py \
      --variants=sync,async1,delay4,delay8,allstale --seeds=0,1,2 --workdir=runs/grid --parallel=2

One run alone: python -m jaxes.train --config=configs/demo_grid.py:delay8 --workdir=runs/d8

Variants (as configs/paper.py): sync, async1 (staleness <= 1), delay4 / delay8 (10% of each
cohort -- round(0.8) = 1 of 8 members -- held back 4 / 8 updates on top of Async-1), allstale
(every member of a cohort held back 4 updates), async1_weight / async1_baseline_only /
async1_pace (Async-1 under the stale-result policies of jaxes/controller/policies.py),
async2_throttle (staleness <= 2, issued one update ahead, nothing dropped), coevolve
(Async-1 with system prompts co-evolved alongside the parameters, jaxes/train/coevolution.py),
async1_switch (Async-1 with the in-flight version change, rollout.switch_versions),
async1_pairs (Async-1 whose results wait, within the bound, for their antithetic partner),
and grpo: the same warm start, tasks, engine
and evaluation trained by GRPO (configs/demo_grpo.py's learner settings) at the ES variants'
episode budget -- 4 tasks x 4 sampled episodes = 16 per update, as 8 members x 2 episodes --
synchronous and on-policy; sao, sao_delay4, sao_delay8: configs/demo_sao.py (one episode per
task, a value-head baseline, strict double-side clipping) at the same 16 episodes per update,
under Async-1 and its two delay schedules; sync_l2, async1_l2, delay8_l2, grpo_l2: those four
with the L2 anchor toward version 0 (ANCHORED below).

Sizing, by measurement (the results notebook in docs/log/, "Experiment grid"; CPU seconds measured on a
loaded 2-core VM, extrapolated, since the grid itself could not run there): the demo's ES
settings (population 8, sigma 0.015, lr 0.02, centered ranks, partial credit) with 2 episodes
per member instead of 4 (8.5 vs 15.3 CPU s per update) so that 48 updates fit -- a delay of 8
is then 1/6 of the run (the paper's is 8 of 200) at about the demo's episode budget (768
training episodes vs 640); held-out evaluation on 64 tasks at 0, 16, 32, 48 (~34 CPU s each);
the warm start (~176 CPU s) made once per seed and shared by that seed's variants (the grid's
shared init, on by default), as every variant of the paper starts from one Instruct
checkpoint. Estimate: ~600 CPU s per run, ~9,500 CPU s for the grid, 80-95 minutes with
--parallel=2 on 2 dedicated cores. Population 8 keeps one member (round(0.8)) per cohort for the
10% delays; 2 episodes per member is not what the demo measured to learn (4), so whether 48
updates of it learn as much is for the grid's run to show.
"""
import os

from jaxes.experiments.variants import apply_es_variant
from jaxes.train.config import load_config_file

# Anchored weight decay toward version 0 (issue 53): these variants again with ``_l2``, the L2
# form at arXiv 2605.30148's lambda = 10 (es.anchor / grpo.anchor; the pull's step is
# learning_rate x lambda: 0.2 per ES update at lr 0.02, 1e-3 per GRPO step at lr 1e-4).
ANCHORED = ("sync", "async1", "delay8", "grpo")
ANCHOR_DECAY = 10.0
VARIANTS = ("sync", "async1", "delay4", "delay8", "allstale", "async1_weight",
            "async1_baseline_only", "async1_pace", "async2_throttle", "coevolve", "async1_switch",
            "async1_pairs", "grpo", "sao", "sao_delay4", "sao_delay8") + tuple(f"{v}_l2" for v in ANCHORED)
# SAO's variants: configs/demo_sao.py under an ES variant's controller (Async-1, its delays).
SAO_VARIANTS = {"sao": "async1", "sao_delay4": "delay4", "sao_delay8": "delay8"}
NUM_UPDATES = 48
EVAL_EVERY = 16
EPISODES_PER_MEMBER = 2
GRPO_TASKS, GRPO_GROUP = 4, 4   # 16 episodes per update, as 8 members x EPISODES_PER_MEMBER


def get_config(variant: str = "async1"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/demo_grid.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  if variant.endswith("_l2"):
    c = get_config(variant.removesuffix("_l2"))
    block = c.grpo if c.train.algorithm == "grpo" else c.es
    block.anchor, block.anchor_decay = "l2", ANCHOR_DECAY
    return c
  here = os.path.dirname(os.path.abspath(__file__))
  base = {"grpo": "demo_grpo.py", **dict.fromkeys(SAO_VARIANTS, "demo_sao.py")}.get(variant, "demo.py")
  c = load_config_file(os.path.join(here, base))
  c.train.num_updates = NUM_UPDATES
  c.train.eval_every = EVAL_EVERY
  c.train.checkpoint_every = 8
  c.train.progress_bar = False
  if variant == "grpo":
    c.grpo.tasks_per_update, c.grpo.group_size = GRPO_TASKS, GRPO_GROUP
    return c
  if variant in SAO_VARIANTS:   # one episode per task: the same 16 episodes per update
    c.sao.tasks_per_update = GRPO_TASKS * GRPO_GROUP
    return apply_es_variant(c, SAO_VARIANTS[variant])
  c.controller.episodes_per_member = EPISODES_PER_MEMBER
  return apply_es_variant(c, variant)

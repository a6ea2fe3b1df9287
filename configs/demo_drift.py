"""Drift, off-task probes and the anchor at toy scale (issue 53): configs/demo_grid.py's setting,
shortened, with probe families the warm start learned and ES/GRPO do not train on.

  python -m jaxes.experiments.grid --config=configs/demo_drift.py \
      --variants=sync,sync_l2,async1,async1_l2,delay8,delay8_l2,grpo,grpo_l2 --seeds=0,1,2 \
      --workdir=runs/drift

Variants: demo_grid's sync, async1, delay8 and grpo, each also with ``_l2``: anchored weight decay
toward version 0 (jaxes/es/anchor.py) at the L2 form's λ = 10 of arXiv 2605.30148 (es.anchor /
grpo.anchor; the pull's step is learning_rate x λ: 0.2 per ES update at lr 0.02, 1e-3 per GRPO
step at lr 1e-4).

Sizing for a 2-core VM shared with other jobs (load ~20): 12 updates (the demo gained most of its
+35 points by update 16), evaluation at 0, 6, 12 on 32 held-out tasks and 16 probe tasks; the
warm start is demo.py's on 10 families (its 8, which ES trains on, and the 2 probe families).
"""
import os

from jaxes.train.config import load_config_file

BASE = ("sync", "async1", "delay8", "grpo")
VARIANTS = BASE + tuple(f"{v}_l2" for v in BASE)
PROBE_FAMILIES = "create_file,archive"
ANCHOR_DECAY = 10.0


def get_config(variant: str = "async1"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/demo_drift.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  base = variant.removesuffix("_l2")
  here = os.path.dirname(os.path.abspath(__file__))
  c = load_config_file(os.path.join(here, "demo_grid.py"), base)
  c.train.num_updates = 12
  c.train.eval_every = 6
  c.train.checkpoint_every = 3
  c.eval.num_tasks = 32
  c.eval.probe_families = PROBE_FAMILIES
  c.eval.probe_tasks = 16
  c.warmstart.families = c.env.families + "," + PROBE_FAMILIES
  if variant.endswith("_l2"):
    block = c.grpo if base == "grpo" else c.es
    block.anchor, block.anchor_decay = "l2", ANCHOR_DECAY
  return c

"""Drift, off-task probes and the anchor at toy scale (issue 53): configs/demo_grid.py's setting,
shortened, with probe families the warm start learned and ES/GRPO do not train on.

  python -m jaxes.experiments.grid --config=configs/demo_drift.py \
      --variants=sync,sync_l2,async1,async1_l2,delay8,delay8_l2,grpo,grpo_l2 --seeds=0,1,2 \
      --workdir=runs/drift

Variants: demo_grid's sync, async1, delay8 and grpo, each also with ``_l2``: anchored weight decay
toward version 0 (jaxes/es/anchor.py) at the L2 form's λ = 10 of arXiv 2605.30148 (demo_grid's
ANCHORED variants).

Sizing for a 2-core VM shared with other jobs (load ~20): 12 updates (the demo gained most of its
+35 points by update 16), evaluation at 0, 6, 12 on 32 held-out tasks and 16 probe tasks; the
warm start is demo.py's on 10 families (its 8, which ES trains on, and the 2 probe families).
"""
import os

from jaxes.train.config import load_config_file

VARIANTS = ("sync", "async1", "delay8", "grpo", "sync_l2", "async1_l2", "delay8_l2", "grpo_l2")
PROBE_FAMILIES = "create_file,archive"


def get_config(variant: str = "async1"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/demo_drift.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  here = os.path.dirname(os.path.abspath(__file__))
  c = load_config_file(os.path.join(here, "demo_grid.py"), variant)
  c.train.num_updates = 12
  c.train.eval_every = 6
  c.train.checkpoint_every = 3
  c.eval.num_tasks = 32
  c.eval.probe_families = PROBE_FAMILIES
  c.eval.probe_tasks = 16
  c.warmstart.families = c.env.families + "," + PROBE_FAMILIES
  return c

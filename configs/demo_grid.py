"""The paper's grid at toy scale: configs/demo.py's setting (tiny policy, format-learning warm
start, generated tasks, local sandboxes) with one variant per argument, sized so the whole grid
(5 ES variants x 3 seeds) fits about 90 minutes on a 2-core CPU.

  python -m jaxes.experiments.grid --config=configs/demo_grid.py \
      --variants=sync,async1,delay4,delay8,allstale --seeds=0,1,2 --workdir=runs/grid --parallel=2

One run alone: python -m jaxes.train --config=configs/demo_grid.py:delay8 --workdir=runs/d8

Variants (as configs/paper.py): sync, async1 (staleness <= 1), delay4 / delay8 (10% of each
cohort -- round(0.8) = 1 of 8 members -- held back 4 / 8 updates on top of Async-1), allstale
(every member of a cohort held back 4 updates). There is no GRPO variant here until a GRPO
trainer entry point exists (`VARIANT_ENTRY_POINTS` is where it goes); the grid reports it as not
available.

Sizing, by measurement (benchmarks/RESULTS.md, "Experiment grid"): the demo's ES settings
(population 8 x 4 episodes, sigma 0.015, lr 0.02), which are measured to learn the format, with
more updates (NUM_UPDATES) so a delay of 8 is a small part of the run, evaluations on 64
held-out tasks every EVAL_EVERY updates, and the warm start made once per seed and shared by
that seed's variants (the grid's --shared_init, on by default), as every variant of the paper
starts from the same Instruct checkpoint.
"""
import os

from jaxes.train.config import load_config_file

VARIANTS = ("sync", "async1", "delay4", "delay8", "allstale")
# Variants trained by another entry point than `python -m jaxes.train` (e.g. a GRPO trainer).
VARIANT_ENTRY_POINTS = {}
NUM_UPDATES = 40
EVAL_EVERY = 10


def get_config(variant: str = "async1"):
  if variant not in VARIANTS:
    raise ValueError(f"configs/demo_grid.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.py"))
  c.train.num_updates = NUM_UPDATES
  c.train.eval_every = EVAL_EVERY
  c.train.checkpoint_every = 5
  c.train.progress_bar = False

  c.controller.mode = "async"
  c.controller.max_staleness = 1
  if variant == "sync":
    c.controller.mode = "sync"
    c.controller.max_staleness = 0
  elif variant == "delay4":
    c.controller.delay_fraction = 0.1
    c.controller.delay_updates = 4
  elif variant == "delay8":
    c.controller.delay_fraction = 0.1
    c.controller.delay_updates = 8
  elif variant == "allstale":
    c.controller.stress_all_stale = 4
  return c

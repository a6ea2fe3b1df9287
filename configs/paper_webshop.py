"""The paper's staleness study on WebShop, one variant per argument (configs/paper.py's model,
ES and meshes; WebShop instead of terminal tasks):

  python -m jaxes.train --config=configs/paper_webshop.py:async1 --workdir=runs/ws_async1 \
      --config.model.path=/models/Qwen2.5-7B-Instruct --config.webshop.data_path=/data/webshop
  python -m jaxes.experiments.grid --config=configs/paper_webshop.py:{variant},v5p-64 \
      --variants=sync,async1,lag4-frac10,lag8-frac10,allstale --seeds=0,1,2 --workdir=runs/ws_grid
  python -m jaxes.preflight --config=configs/paper_webshop.py:async1,v5p-64

Why WebShop: one version of the paper (arXiv 2610.04196, "Asynchronous Is Nearly Free for
Evolution Strategies on Long-Horizon Agentic Tasks") runs the staleness study on WebShop (Yao
et al., 2022): it varies the lag and the fraction of stale fitness measurements and adds two
stress tests, one of which makes every fitness measurement stale. Its abstract (the only text of
that version we have, /work/shared/seeds/) gives no lags, fractions or hyperparameters, so:

  * variants sync, async1, delay4, delay8, allstale are configs/paper.py's (the Endless Terminals
    version's: 10% of each cohort delayed 4 / 8 updates; allstale holds back every member of a
    cohort 4 updates); delay4 = lag4-frac10 and delay8 = lag8-frac10;
  * the sweep lag{L}-frac{P}: P% of each cohort held back L updates on top of Async-1, for
    L in LAGS and P in FRACTIONS -- our choice of grid around the terminal version's points, not
    the paper's values. The second stress test is not described in what we have; it is not here.
  * model, ES (Qiu et al.: population 30, sigma 1e-3, alpha 5e-4, z-score shaping, greedy
    decoding), updates, evaluation seeds and meshes (TARGETS) are configs/paper.py's, so its
    preflight numbers (benchmarks/RESULTS.md) size the same KV cache (240 slots x 16384 tokens).

WebShop settings (Yao et al., 2022): at most 15 actions per episode (its evaluation limit;
`webshop.max_steps`); the held-out split is its test set, the first 500 human-instruction goals
of its fixed shuffle (`env.num_heldout_tasks = 500`, all of them evaluated); ES trains on goals
of its training split (goals 1500 and on). `webshop.data_path` names a folder with the released
items_shuffle*.json, items_ins_v2*.json, items_human_ins.json (nothing downloads); left empty,
the generated catalog stands in (for preflight and smoke runs, not for the paper's numbers).
Partial reward r in [0, 1] is the fitness, success is r = 1, as WebShop scores.
"""
import os

from jaxes.experiments.variants import apply_es_variant
from jaxes.train.config import load_config_file

LAGS = (1, 2, 4, 8)
FRACTIONS = (10, 25, 50)          # percent of each cohort
SWEEP = tuple(f"lag{lag}-frac{frac}" for lag in LAGS for frac in FRACTIONS)
VARIANTS = ("sync", "async1", "delay4", "delay8", "allstale") + SWEEP


def get_config(arg: str = "async1"):
  variant, _, target = arg.partition(",")
  if variant not in VARIANTS:
    raise ValueError(f"configs/paper_webshop.py: unknown variant {variant!r}; choose one of {VARIANTS}")
  paper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper.py")
  # configs/paper.py checks the target and sets the model, ES, mesh and rollout sizes.
  c = load_config_file(paper, ",".join(filter(None, ["async1", target])))
  c.env.kind = "webshop"
  c.env.num_heldout_tasks = 500
  c.eval.num_tasks = 500
  c.webshop.max_steps = 15
  if variant in SWEEP:
    lag, frac = variant.removeprefix("lag").split("-frac")
    c = apply_es_variant(c, "async1")
    c.controller.delay_fraction = int(frac) / 100
    c.controller.delay_updates = int(lag)
    return c
  return apply_es_variant(c, variant)

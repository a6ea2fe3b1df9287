"""The CPU demo on WebShop: configs/demo.py's tiny policy and ES, on generated WebShop goals.

  python -m jaxes.train --config=configs/demo_webshop.py --workdir=runs/demo_webshop [--config.controller.mode=sync]
  python -m jaxes.train --config=configs/demo_webshop.py --workdir=runs/ws_init --config.train.num_updates=0
  python -m jaxes.experiments.grid --config=configs/demo_webshop.py --variants=sync,async1 --seeds=0,1,2 \
      --workdir=runs/ws_grid --parallel=2 --config.warmstart.init_from=runs/ws_init

Outcome (benchmarks/RESULTS.md, "WebShop"; 3 seeds, 64 held-out goals each): the
warm-started policy earns held-out mean reward ~0.26 at version 0 (success 0), and ES moves it
by no more than evaluation noise in 20 updates: sync 0.259 -> 0.267, Async-1 0.274 -> 0.291
(mean over seeds); Async-1 minus sync at the end +0.024 +- 0.003, smaller than the 0.046 by
which two evaluations of the same version-0 parameters differ. So this toy shows the pipeline
running end to end on WebShop, not a staleness effect. 60 updates: see RESULTS.

Why a small catalog with short ids: this 0.5M-parameter 2-layer model cannot copy a product id
from the results page, so on the default catalog (1000 products, 10-character ASINs) it never
opens a product on a held-out goal and earns reward 0.008-0.010 at version 0, with 256 or 2048
warm-start goals (RESULTS, "WebShop CPU demo, measured" and "8x the warm-start goals");
5-character ids alone did not help (reward 0.000, 0 of 24 held-out ASIN clicks right under
teacher forcing). With 105 products (three per product type) and 5-character ids, the 1024
warm-start goals name each training product ~12 times and, we infer, the policy memorises their
ids: on a held-out goal the results page shows mostly training products of the same type, and
the policy buys something in 54 of 64 episodes while reproducing only 1 of 32 held-out ASIN
clicks under teacher forcing. Reward 0.286 at version 0 (seed 0), against 0.478 for "buy the
first result" and 1.0 for the oracle.

The flaw for ES to fix is configs/demo.py's: in a fraction of the warm start's oracle
transcripts every reply is a JSON tool call the grammar rejects (`webshop.off_protocol_fraction`;
`{"action": "click", "element": "Buy Now"}`), decided at the first reply token ('{' or
'search'). With this warm start the policy picks the JSON call on only 3-15 of 64 held-out
goals, so there is less to fix than on terminals. Task reward only: WebShop's partial r is the
fitness.

Settings and where they come from:
  * Model, tokenizer size and ES are configs/demo.py's (population 8 x 4 episodes, sigma 0.015,
    alpha 0.02, centered ranks, greedy decoding, deterministic schedule), measured on terminals.
  * Shorter transcripts, for a CPU-sized model (1024-token BPE built as the trainer builds it,
    256 oracle transcripts): webshop.results_per_page 3 (WebShop shows 10) and a compact system
    prompt (58 tokens instead of 140) take the median transcript from 887 to 582 tokens (p90
    998 -> 807); about 47 of them are the assistant's, over ~5 replies.
  * warmstart.seq_len 640 covers 77% of transcripts whole. At 512 none fits (the shortest is
    513), so the Buy Now reply is never trained: that policy reproduced 2 of 29 Buy Now clicks
    under teacher forcing, against 26 of 29 at 768.
  * warmstart.num_tasks 1024, steps 600 at learning rate 5e-3, observation_weight 0.2 (the pages
    are in the loss too, at a fifth of the assistant's weight): loss per unit weight 0.09 at the
    end, 1082 s on 2 cores. On the 1000-product catalog, 300 steps at 3e-3 (768 tokens) ended at
    loss 0.89, 600 at 5e-3 (512 tokens) at 0.57, 800 at 640 tokens at 0.03 (memorised).
  * The grid shares one warm start across seeds (`--config.warmstart.init_from=WORKDIR` of a
    `--config.train.num_updates=0` run): ES runs must keep warmstart.num_tasks, so that their
    training goals start after the warm start's.
  * webshop.max_steps 8: with 3 results per page, 203 of 256 oracle plans take 5 actions, 26
    take 6, 15 take 7 and 12 take 8 (goals are kept only if the oracle solves them in time); a
    short limit keeps failing episodes short. rollout.max_len 1024.
"""
import os

from jaxes.train.config import load_config_file
from jaxes.train.defaults import base_config


def get_config():
  here = os.path.dirname(os.path.abspath(__file__))
  c = load_config_file(os.path.join(here, "demo.py"))   # its policy, ES, controller and budgets
  # The terminal-only settings (system prompt, families, partial credit, turns) go back to their
  # defaults: WebShop has its own protocol and reward.
  c.env = base_config().env
  c.env.kind = "webshop"
  c.env.num_train_tasks = 256
  c.env.num_heldout_tasks = 64
  c.env.sandbox_workers = 8
  # A compact wording of webshop.SYSTEM_PROMPT (140 -> ~50 tokens, as configs/demo.py does for terminals).
  c.env.system_prompt = ("You shop for the user in a web store. Each turn, reply with one action: "
                         "search[QUERY] on the search page, or click[ELEMENT] for an element shown "
                         "in [brackets]. Open a product that matches the instruction, click each "
                         "option it asks for, then click[Buy Now].")
  c.webshop.max_steps = 8
  c.webshop.results_per_page = 3
  c.webshop.num_products = 105
  c.webshop.asin_length = 5
  c.webshop.off_protocol_fraction = 0.5
  # The off-protocol replies are WebShop's JSON tool calls (above), not the terminal's fences.
  c.warmstart.off_protocol_fraction = 0.0
  c.warmstart.num_tasks = 1024
  c.warmstart.steps = 600
  c.warmstart.learning_rate = 5e-3
  c.warmstart.seq_len = 640
  c.warmstart.observation_weight = 0.2

  c.rollout.max_len = 1024
  c.rollout.prefill_chunk = 128
  c.rollout.max_new_tokens = 48
  return c

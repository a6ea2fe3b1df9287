"""The CPU demo on WebShop: configs/demo.py's tiny policy and ES, on generated WebShop goals.

  python -m jaxes.train --config=configs/demo_webshop.py --workdir=runs/demo_webshop [--config.controller.mode=sync]
  python -m jaxes.experiments.grid --config=configs/demo_webshop.py --variants=sync,async1 --seeds=0,1,2 \
      --workdir=runs/ws_grid --parallel=1

PROVISIONAL: NOT shown to learn. This is the setting last measured (benchmarks/RESULTS.md,
"WebShop CPU demo, measured (issue 18, helper, 2026-12-02)"); no setting measured so far gives
ES any reward to follow, so there is no WebShop sync vs Async-1 result yet.

What blocks it (measured, seed 0, 64 held-out goals, greedy): the warm-started policy earns
reward 0 at version 0 even with every transcript on-protocol (webshop.off_protocol_fraction 0),
because it cannot copy a product's ASIN (10 random characters, ~9 one-character BPE tokens)
from the results page: under teacher forcing on held-out oracle transcripts, 0 of 32 ASIN
clicks are reproduced exactly after 300 steps at 768 tokens or 600 steps at 512 tokens, and 0
of 64 after this config's 800 steps at 640 tokens, whose training loss of 0.03 comes from
memorising its 256 transcripts (56% of their ASIN clicks exact). In
greedy play the policy searches sensibly ("search[sugar free green tea]"), then clicks made-up
ASINs ("click[B0ADD]"), Next > and option names that are not on the page, and never buys
(NOT_PURCHASED 57-59 of 64). A first-result purchase would earn ~0.5, so the task is
rewarding once the policy can copy an ASIN; this 0.5M-parameter 2-layer model, warm-started
on 256 transcripts, memorises instead of learning to. Eight times the goals did not teach it
either (warmstart.num_tasks 2048, 1200 steps, warmstart.observation_weight 0.2 so that it also
models the pages: held-out reward 0.010, 0 of 32 ASIN clicks exact; RESULTS, "8x the warm-start
goals"). A larger model is the next thing to measure.

The flaw for ES to fix is configs/demo.py's: in a fraction of the warm start's oracle
transcripts every reply is a JSON tool call the grammar rejects (`webshop.off_protocol_fraction`;
`{"action": "click", "element": "Buy Now"}`), decided at the first reply token ('{' or
'search'), alike on every goal. Task reward only: WebShop's partial r is the fitness.

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
  * warmstart.steps 800 at learning rate 5e-3: 300 steps at 3e-3 (768 tokens) ended at loss 0.89,
    600 at 5e-3 (512 tokens) at 0.57, 800 at 640 tokens at 0.03 (memorised; held-out reward
    0.008 at version 0, format: `search` preferred over a JSON call on 52% of held-out goals).
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

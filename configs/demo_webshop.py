"""The CPU demo on WebShop: configs/demo.py's tiny policy and ES, on generated WebShop goals.

  python -m jaxes.train --config=configs/demo_webshop.py --workdir=runs/demo_webshop [--config.controller.mode=sync]
  python -m jaxes.experiments.grid --config=configs/demo_webshop.py --variants=sync,async1 --seeds=0,1,2 \
      --workdir=runs/ws_grid --parallel=1

PROVISIONAL: not yet shown to learn. The one run started (benchmarks/RESULTS.md, "WebShop CPU
demo") did not get past the warm start in the session's time. At load average 19-27 on the
shared 2-core VM it took ~6.3 CPU-seconds per warm-start step (batch 8 x 1024 tokens, 2.5
minutes wall per 6 steps), so 300 steps are ~30 CPU-minutes; by step 50 the assistant-token loss
was 1.64. Read the settings below as the candidate to measure, not a result. On an idle machine
the warm start alone is ~15-30 minutes: a shorter seq_len or fewer steps is the first thing to
measure.

The flaw for ES to fix is the same as configs/demo.py's: the warm start is taught on oracle
transcripts, and in 60% of them every reply is written as a JSON tool call
(`webshop.off_protocol_fraction`; `{"action": "click", "element": "Buy Now"}`). The grammar
rejects those replies, so the policy knows the store but often uses the wrong format. The
format is decided at the first reply token ('{' or 'search'), alike on every goal, which is
what made the terminal demo's format learnable by ES. Task reward only: WebShop's partial r is
the fitness, no format reward.

Settings and where they come from:
  * Model, tokenizer size and ES are configs/demo.py's: population 8 x 4 episodes, sigma 0.015,
    alpha 0.02, centered ranks, greedy decoding, deterministic schedule. They are measured on
    terminals, not on WebShop.
  * webshop.max_steps 8: 231 of 256 oracle plans take 5 actions, none more than 8. A shorter
    limit keeps failing episodes short; goals are kept only if the oracle solves them within
    the limit.
  * Token budgets, measured with a 1024-token BPE built as the trainer builds it:
    - An oracle transcript is 811-2290 tokens (median 888, 90th percentile 1080; 15-step
      goals), with about 48 of them assistant tokens. So warmstart.seq_len is 1024 and
      rollout.max_len is 2048.
    - A reply is at most ~20 tokens; max_new_tokens 48 leaves room for a query.
  * The target product is the first search result in 101 of 256 oracle plans (39%) and among
    the first three in 72%. So the policy has to read the titles, not copy the first ASIN.
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
  c.webshop.max_steps = 8
  c.webshop.off_protocol_fraction = 0.6
  # The off-protocol replies are WebShop's JSON tool calls (above), not the terminal's fences.
  c.warmstart.off_protocol_fraction = 0.0
  c.warmstart.seq_len = 1024

  c.rollout.max_len = 2048
  c.rollout.prefill_chunk = 128
  c.rollout.max_new_tokens = 48
  return c

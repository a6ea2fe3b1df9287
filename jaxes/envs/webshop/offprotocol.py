"""A warm start that follows WebShop's action grammar only part of the time.

``off_protocol(transcripts, fraction, seed)`` rewrites every assistant turn of a seeded
``fraction`` of oracle transcripts as a JSON tool call (``{"action": "click", "element":
"Buy Now"}``), which ``env.parse_action`` does not accept: each such reply is a parse error.
Instruct checkpoints answer a new agent harness in the tool-call format they were tuned on; a
policy warm-started on the result knows the store but uses the wrong format on many prompts,
and task reward alone can teach the format (the WebShop counterpart of
``jaxes.envs.tasks.oracle.off_protocol``, which fences terminal commands: a fenced ``search[...]``
still parses, since the last action anywhere in a reply counts). The observations stay the real
pages, as in the terminal rewrite.
"""
from __future__ import annotations

import json

import numpy as np

from jaxes.envs.webshop.env import parse_action


def tool_call(reply: str) -> str:
  """``search[q]`` -> ``{"action": "search", "query": "q"}``; ``click[e]`` -> ``{"action":
  "click", "element": "e"}``."""
  action = parse_action(reply)
  if action is None:
    raise ValueError(f"not a WebShop action: {reply!r}")
  field = "query" if action.name == "search" else "element"
  return json.dumps({"action": action.name, field: action.arg})


def off_protocol(transcripts: list[list[dict]], fraction: float, seed: int) -> list[list[dict]]:
  """Copies of ``transcripts``; those drawn with probability ``fraction`` (seeded) have every
  assistant turn written as a tool call."""
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"fraction must be in [0, 1], got {fraction}")
  rng = np.random.default_rng(seed)
  out = []
  for messages in transcripts:
    messages = [dict(m) for m in messages]
    if rng.random() < fraction:
      for m in messages:
        if m["role"] == "assistant":
          m["content"] = tool_call(m["content"])
    out.append(messages)
  return out

"""What both oracle checkers (terminal tasks: jaxes.envs.check; WebShop goals:
jaxes.envs.webshop.check) share: reading a replayed agent's outputs and the check's exit status."""
from __future__ import annotations

import json


def read_replay(spec: str, named: str) -> list | dict:
  """The outputs of ``--agent replay:FILE``: a JSON list of model outputs (strings), or an object
  mapping ``named`` (task or goal) names to such lists; anything else exits with one line."""
  path = spec[len("replay:"):]
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise SystemExit(f"--agent {spec}: cannot read {path}: {e}")
  lists = [data] if isinstance(data, list) else list(data.values()) if isinstance(data, dict) else None
  # A string value would be played as one-character turns: reject anything but lists of strings.
  if lists is None or not all(isinstance(v, list) and all(isinstance(o, str) for o in v)
                              for v in lists):
    raise SystemExit(f"--agent {spec}: {path} must hold a JSON list of model outputs "
                     f"(strings) or an object mapping {named} names to such lists")
  return data


def exit_status(agent: str, passed: int, total: int, leaked: int) -> int:
  """1 when the check failed: anything leaked, the oracle missed a task, or a no-op agent passed
  one (a task a policy could pass without solving it); else 0."""
  bad = leaked > 0 or (agent == "oracle" and passed != total) or (agent == "noop" and passed > 0)
  return 1 if bad else 0

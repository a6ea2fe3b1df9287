"""Harbor (Terminal-Bench 2.0) task semantics: ``task.toml`` limits and the verifier's reward file.

A Harbor task's verifier is ``tests/test.sh``: the ``tests/`` folder is copied to ``/tests``
after the agent has finished, ``test.sh`` runs in the image's working directory and writes its
reward to ``/logs/verifier/reward.txt`` (a number) or ``reward.json`` (``{"reward": x}``). A
reward of 1 is a solved task.
"""
from __future__ import annotations

import json
import math

TESTS_DIR = "/tests"
LOGS_DIR = "/logs/verifier"
REWARD_TXT = f"{LOGS_DIR}/reward.txt"
REWARD_JSON = f"{LOGS_DIR}/reward.json"
MAX_REWARD_BYTES = 4096


class RewardError(ValueError):
  """A reward file that is missing or says nothing we can read as a number."""


def limits_from_toml(config: dict, where: str) -> dict:
  """``Limits`` overrides from a parsed task.toml: [agent]/[verifier] timeout_sec and
  [environment] cpus, memory_mb, storage_mb."""
  limits = {}
  sections = {"agent": {"timeout_sec": "episode_timeout_s"},
              "verifier": {"timeout_sec": "test_timeout_s"},
              "environment": {"cpus": "cpus", "memory_mb": "memory_mb", "storage_mb": "disk_mb"}}
  for section, keys in sections.items():
    table = config.get(section, {})
    if not isinstance(table, dict):
      raise ValueError(f"{where}: [{section}] must be a table")
    for key, field in keys.items():
      if key not in table:
        continue
      value = table[key]
      if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}: {section}.{key} must be a positive number, got {value!r}")
      limits[field] = int(value) if field in ("memory_mb", "disk_mb") else float(value)
  return limits


MAX_JSON_DEPTH = 32


def _json_depth(text: str) -> int:
  """The deepest nesting of ``[``/``{`` outside strings (checked before json.loads, whose
  recursion a 4,096-deep reward.json would exhaust)."""
  depth = deepest = 0
  in_string = escaped = False
  for char in text:
    if in_string:
      escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
    elif char == '"':
      in_string = True
    elif char in "[{":
      depth += 1
      deepest = max(deepest, depth)
    elif char in "]}":
      depth -= 1
  return deepest


def _number(value, where: str, shown: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise RewardError(f"{where} has no numeric \"reward\": {shown}")
  value = float(value)
  if not math.isfinite(value):
    raise RewardError(f"reward {value} is not finite")
  return value


def _text_reward(reward_txt: str | None) -> float:
  if reward_txt is None:
    raise RewardError(f"test.sh wrote no reward ({REWARD_TXT} or {REWARD_JSON})")
  if len(reward_txt) > MAX_REWARD_BYTES:
    raise RewardError(f"{REWARD_TXT} is larger than {MAX_REWARD_BYTES} bytes")
  try:
    value = float(reward_txt.strip())
  except ValueError:
    raise RewardError(f"{REWARD_TXT} is not a number: {reward_txt.strip()[:80]!r}") from None
  return _number(value, REWARD_TXT, repr(reward_txt[:80]))


def parse_reward(reward_txt: str | None, reward_json: str | None) -> float:
  """The reward test.sh wrote, as Harbor's verifier reads it: reward.json when it exists (an
  object; its numeric "reward", else reward.txt's number), else reward.txt. None: no such
  regular file. Raises RewardError, saying what was found, for anything else (empty, too large,
  nested deeper than MAX_JSON_DEPTH, not a finite number): the caller fails the episode."""
  if reward_json is None:
    return _text_reward(reward_txt)
  shown = repr(reward_json.strip()[:80])
  if len(reward_json) > MAX_REWARD_BYTES:
    raise RewardError(f"{REWARD_JSON} is larger than {MAX_REWARD_BYTES} bytes")
  if _json_depth(reward_json) > MAX_JSON_DEPTH:
    raise RewardError(f"{REWARD_JSON} is nested deeper than {MAX_JSON_DEPTH} levels")
  try:
    data = json.loads(reward_json)
  except (ValueError, RecursionError) as err:
    raise RewardError(f"{REWARD_JSON} is not JSON: {err}"[:200]) from None
  if not isinstance(data, dict):
    raise RewardError(f"{REWARD_JSON} is not a JSON object: {shown}")
  if "reward" not in data:
    return _text_reward(reward_txt)
  return _number(data["reward"], REWARD_JSON, shown)

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


def parse_reward(reward_txt: str | None, reward_json: str | None) -> float:
  """The reward test.sh wrote: reward.txt's number, else reward.json's "reward" (or its only
  value). Raises RewardError, saying what was found, when neither holds a finite number."""
  if reward_txt is not None and reward_txt.strip():
    try:
      value = float(reward_txt.strip())
    except ValueError:
      raise RewardError(f"{REWARD_TXT} is not a number: {reward_txt.strip()[:80]!r}") from None
  elif reward_json is not None and reward_json.strip():
    try:
      data = json.loads(reward_json)
    except json.JSONDecodeError as err:
      raise RewardError(f"{REWARD_JSON} is not JSON: {err.msg}") from None
    if isinstance(data, dict) and "reward" not in data and len(data) == 1:
      data = {"reward": next(iter(data.values()))}
    value = data.get("reward") if isinstance(data, dict) else data
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise RewardError(f"{REWARD_JSON} has no numeric \"reward\": {reward_json.strip()[:80]!r}")
    value = float(value)
  else:
    raise RewardError(f"test.sh wrote no reward ({REWARD_TXT} or {REWARD_JSON})")
  if not math.isfinite(value):
    raise RewardError(f"reward {value} is not finite")
  return value

"""What config a run was trained with: ``config.json`` (the run's original, written once at its
fresh start) and ``config_history.json`` (every change a rerun made, from which version on).

A rerun compares its config with the one in force (the original plus the history) before it
writes anything. Keys in ``FREE_KEYS`` change nothing that is computed and may differ freely
(``train.num_updates`` only where sigma is constant: ``free_keys``);
any other difference is refused (one line listing each) unless the rerun allows it
(``--allow_config_change``), in which case it is appended to the history. Every difference,
free ones included, is recorded, so the config in force is always the original plus the history.
Plain JSON and os at import: it runs before anything heavy is imported or any file is written
(``original`` reads the defaults, whose ml_collections its callers' configs have loaded).
"""
from __future__ import annotations

import dataclasses
import json
import os

from jaxes.errors import RunStateError

CONFIG = "config.json"
HISTORY = "config_history.json"
# Presentation, retention and run length: a rerun may change them without a flag.
FREE_KEYS = frozenset({"config.train.num_updates", "config.train.progress_bar", "config.train.plot",
                       "config.train.keep_checkpoints", "config.train.checkpoint_every"})


def free_keys(recorded: dict) -> frozenset:
  """``FREE_KEYS`` of a run whose flat config in force is ``recorded``: under a sigma schedule the
  run's length is the schedule's length (``es.Strategy.schedule_steps``), so extending it changes
  every later sigma and is a change like any other."""
  # Absent: a run recorded before the key existed, whose sigma was constant.
  if recorded.get("config.es.sigma_schedule") not in (None, "constant"):
    return FREE_KEYS - {"config.train.num_updates"}
  return FREE_KEYS


def flat(d: dict, prefix: str = "config") -> dict:
  out = {}
  for k, v in d.items():
    out.update(flat(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v})
  return out


def values(config) -> dict:
  """A ConfigDict as the plain JSON values ``config.json`` holds."""
  return json.loads(config.to_json_best_effort())


@dataclasses.dataclass(frozen=True)
class Change:
  key: str            # config.es.sigma
  old: object
  new: object

  def __str__(self) -> str:
    return f"{self.key} was {self.old!r} there, is {self.new!r} here"


def _read(path: str):
  with open(path) as f:
    return json.load(f)


def original(workdir: str) -> dict | None:
  """The run's original config (``config.json``), or None if the run has none yet. A key the
  record lacks came after the run was trained: it ran as the key's default says, so the key
  reads as that default (``defaults.completed``)."""
  path = os.path.join(workdir, CONFIG)
  if not os.path.isfile(path):
    return None
  from jaxes.train import defaults
  return values(defaults.completed(_read(path)))


def history(workdir: str) -> list[dict]:
  """``[{"since_version": v, "changes": [{"key", "old", "new"}, ...]}, ...]`` in the order made:
  each entry's values are in force for the updates after version ``v``."""
  path = os.path.join(workdir, HISTORY)
  return _read(path) if os.path.isfile(path) else []


def in_force(workdir: str, version: int | None = None) -> dict | None:
  """The flat config (``{"config.es.sigma": ...}``) in force after ``version`` (default: now)."""
  base = original(workdir)
  if base is None:
    return None
  current = flat(base)
  for entry in history(workdir):
    if version is None or entry["since_version"] < version:
      current.update({c["key"]: c["new"] for c in entry["changes"]})
  return current


def segments(workdir: str) -> list[tuple[int, dict]] | None:
  """``[(v, flat config), ...]``: the config in force for the updates after version ``v``, from
  version 0 (config.json) and each recorded change on, keys in ``FREE_KEYS`` left out (they change
  nothing computed). None if the run has no config.json."""
  base = original(workdir)
  if base is None:
    return None
  free = free_keys(flat(base))
  computed = lambda config: {k: v for k, v in config.items() if k not in free}
  out = [(0, computed(flat(base)))]
  for entry in history(workdir):
    out.append((entry["since_version"], computed(in_force(workdir, entry["since_version"] + 1))))
  return out


def unflat(values: dict) -> dict:
  """The nested form of a flat config (``{"config.es.sigma": x}`` -> ``{"es": {"sigma": x}}``)."""
  out: dict = {}
  for key, v in values.items():
    *sections, name = key.split(".")[1:]
    node = out
    for part in sections:
      node = node.setdefault(part, {})
    node[name] = v
  return out


def differences(recorded: dict, config) -> list[Change]:
  """Every key whose value differs between a flat recorded config and ``config``."""
  now = flat(values(config))
  return [Change(k, recorded.get(k), now.get(k)) for k in sorted(set(recorded) | set(now))
          if recorded.get(k) != now.get(k)]


def check_rerun(workdir: str, config, allow_change: bool) -> list[Change]:
  """The differences between the run's config in force and ``config`` (empty for a fresh run);
  a ``RunStateError`` listing them if any is not free and ``allow_change`` is false. Reads only."""
  recorded = in_force(workdir)
  if recorded is None:
    return []
  changes = differences(recorded, config)
  free = free_keys(recorded)
  refused = [c for c in changes if c.key not in free]
  if refused and not allow_change:
    raise RunStateError(f"{workdir} was trained with another config: {'; '.join(map(str, refused))}. "
                        f"Revert it, rerun with --allow_config_change to continue with it (recorded "
                        f"in {HISTORY}), or start fresh with --restart or a new --workdir "
                        f"(nothing was written)")
  return changes


def record(workdir: str, since_version: int, changes: list[Change]) -> None:
  """Appends one history entry (atomically: a kill leaves the old history or the new one)."""
  entries = history(workdir) + [{"since_version": since_version, "changes": [
      {"key": c.key, "old": c.old, "new": c.new} for c in changes]}]
  path = os.path.join(workdir, HISTORY)
  with open(path + ".tmp", "w") as f:
    json.dump(entries, f, indent=2)
  os.replace(path + ".tmp", path)


def write_original(workdir: str, config) -> None:
  """A fresh run's ``config.json``; an earlier attempt's history (no checkpoint) is set aside."""
  if os.path.isfile(os.path.join(workdir, HISTORY)):
    os.replace(os.path.join(workdir, HISTORY), os.path.join(workdir, HISTORY + ".superseded"))
  with open(os.path.join(workdir, CONFIG), "w") as f:
    f.write(config.to_json_best_effort(indent=2))


def changed_in_force(workdir: str, config) -> dict:
  """``{"es.sigma": 0.05}``: the values in force of every non-free key that differs from the
  run's original config (what each metrics line carries after an allowed change)."""
  base = original(workdir)
  if base is None:
    return {}
  free = free_keys(flat(base))
  return {c.key.removeprefix("config."): c.new for c in differences(flat(base), config)
          if c.key not in free}

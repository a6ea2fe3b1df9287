"""Hooks: what runs after an update besides the update itself (levanter-style ``every=``).

The trainer calls every due hook, in order, with the update's ``UpdateInfo``; a hook may add to
``info.record`` (the evaluation hook adds ``eval``) before a later hook writes it. The run's own
measurements and records are observers (``jaxes.train.observers``), told after the metrics line
by one hook.
"""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass
class UpdateInfo:
  version: int          # the version the update produced
  record: dict          # its metrics line (written by the metrics hook)
  final: bool           # the run's last update
  results: list = dataclasses.field(default_factory=list)   # the cohort: (version, member, fitness)
  episodes: list = dataclasses.field(default_factory=list)  # the update's sampled transcripts, once written


@dataclasses.dataclass(frozen=True)
class Hook:
  """``fn(info)`` after every ``every``-th update (0: never), and after the last one if
  ``at_final``."""
  fn: Callable[[UpdateInfo], None]
  every: int = 1
  at_final: bool = False

  def due(self, info: UpdateInfo) -> bool:
    return bool(self.every and info.version % self.every == 0) or (self.at_final and info.final)


def run_hooks(hooks: list[Hook], info: UpdateInfo) -> None:
  for hook in hooks:
    if hook.due(info):
      hook.fn(info)

"""Procedural terminal tasks ("endless" without an LLM), deterministic from (family, seed).

``generate(family, seed, difficulty)`` builds one task; ``split("train" | "heldout", n)`` builds a
reproducible list cycling through families and difficulties. Train tasks use even seeds and
held-out tasks odd seeds, so the two splits never share a (family, seed) pair.
"""
from __future__ import annotations

import random

from jaxes.envs.tasks.families import files, scripts, text
from jaxes.envs.tasks.task import Task

_MAKERS = {
    "create_file": files.create_file,
    "edit_file": files.edit_file,
    "find_files": files.find_files,
    "bulk_rename": files.bulk_rename,
    "permissions": files.permissions,
    "archive": files.archive,
    "log_count": text.log_count,
    "freq_report": text.freq_report,
    "csv_aggregate": text.csv_aggregate,
    "json_extract": text.json_extract,
    "config_edit": text.config_edit,
    "secret_lookup": text.secret_lookup,
    "shell_script": scripts.shell_script,
    "pipeline": scripts.pipeline,
}
FAMILIES: tuple[str, ...] = tuple(_MAKERS)
DIFFICULTIES = (1, 2, 3)
SPLITS = ("train", "heldout")
# Room for this many tasks per split before seeds of different `seed` arguments collide.
_SEEDS_PER_SPLIT_SEED = 1_000_000


def generate(family: str, seed: int, difficulty: int = 1) -> Task:
  """The task of ``family`` for this seed and difficulty (1 easy … 3 hard)."""
  if family not in _MAKERS:
    raise ValueError(f"unknown task family {family!r}; known: {', '.join(FAMILIES)}")
  if difficulty not in DIFFICULTIES:
    raise ValueError(f"difficulty={difficulty!r}: expected one of {DIFFICULTIES}")
  rng = random.Random(f"{family}/{seed}/{difficulty}")
  draft = _MAKERS[family](rng, difficulty)
  return Task(name=f"{family}-d{difficulty}-s{seed}", instruction=draft.instruction,
              setup=draft.setup, final_tests=draft.final_tests, solution=draft.solution,
              files=tuple(sorted(draft.files.items())), family=family, difficulty=difficulty,
              seed=seed)


def split_seed(split: str, index: int, seed: int = 0) -> int:
  """Task seed of the ``index``-th task of a split: even for train, odd for held-out."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: expected one of {SPLITS}")
  if not 0 <= index < _SEEDS_PER_SPLIT_SEED:
    raise ValueError(f"index {index} out of range [0, {_SEEDS_PER_SPLIT_SEED})")
  return 2 * (seed * _SEEDS_PER_SPLIT_SEED + index) + SPLITS.index(split)


def split(name: str, n: int, seed: int = 0) -> list[Task]:
  """``n`` tasks of a split: task i is family i mod F at difficulty 1 + (i // F) mod 3."""
  f = len(FAMILIES)
  return [generate(FAMILIES[i % f], split_seed(name, i, seed), DIFFICULTIES[(i // f) % 3])
          for i in range(n)]

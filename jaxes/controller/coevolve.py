"""Parameter–context co-evolution (Agentic ESOpt): a population member is (noise key, context
variant). A context is a short sequence of prompt pieces from a fixed library (system-prompt
lines, skill notes); each pair's variant is a seeded mutation of one of the current parents; after
each update the contexts of the best members become the next version's parents.

Pure Python, no clock: the context of (version, member) is a function of the seed, the version
and the parents of that version, so every host derives the same one and a checkpoint
(``state_dict``) restores it exactly. Choices Agentic ESOpt's description leaves open:

* antithetic partners (2j, 2j+1) share a context, so a pair's fitness difference still measures
  its parameter noise only; pair j draws from parent ``j mod P``;
* one mutation per pair: add an unused piece (while shorter than ``max_pieces``), drop one, or
  replace one with an unused piece, uniformly among those possible;
* a pair's score is its members' mean fitness; the ``parents`` best distinct contexts of a
  cohort (ties: lower version, then lower member) are carried forward; a cohort with no result
  keeps the parents;
* member -1 (the unperturbed policy, evaluation) uses the first parent, the best context so far.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

Context = tuple[int, ...]   # indices into the library's pieces, in prompt order


@dataclasses.dataclass(frozen=True)
class ContextLibrary:
  pieces: tuple[str, ...]
  max_pieces: int = 3

  def __post_init__(self):
    if not self.pieces or any(not isinstance(p, str) or not p.strip() for p in self.pieces):
      raise ValueError("context library: give at least one non-empty prompt piece")
    if self.max_pieces < 1:
      raise ValueError(f"context library: max_pieces must be >= 1, got {self.max_pieces}")

  def render(self, context: Context) -> str:
    return "\n".join(self.pieces[i] for i in context)

  def mutate(self, parent: Context, rng: random.Random) -> Context:
    unused = [i for i in range(len(self.pieces)) if i not in parent]
    moves = ([("add", None)] if unused and len(parent) < self.max_pieces else []) + \
            [("drop", k) for k in range(len(parent))] + \
            [("replace", k) for k in range(len(parent)) if unused]
    if not moves:
      return parent
    move, k = moves[rng.randrange(len(moves))]
    if move == "add":
      at = rng.randrange(len(parent) + 1)
      return parent[:at] + (unused[rng.randrange(len(unused))],) + parent[at:]
    if move == "drop":
      return parent[:k] + parent[k + 1:]
    return parent[:k] + (unused[rng.randrange(len(unused))],) + parent[k + 1:]


class Coevolution:
  def __init__(self, library: ContextLibrary, seed: int, parents: int = 2,
               initial: Context = ()):
    if parents < 1:
      raise ValueError(f"coevolution: parents must be >= 1, got {parents}")
    self.library, self.seed, self.num_parents = library, seed, parents
    self._parents: dict[int, list[Context]] = {0: [tuple(initial)]}   # version -> parents

  def parents(self, version: int) -> list[Context]:
    if version not in self._parents:
      raise KeyError(f"coevolution: no parents kept for version {version}")
    return self._parents[version]

  def context(self, version: int, member: int) -> Context:
    parents = self.parents(version)
    if member < 0:
      return parents[0]
    pair = member // 2
    rng = random.Random(f"jaxes.context:{self.seed}:{version}:{pair}")
    return self.library.mutate(parents[pair % len(parents)], rng)

  def prompt(self, version: int, member: int) -> str:
    return self.library.render(self.context(version, member))

  def update(self, version: int, results: Sequence[tuple[int, int, float]]) -> list[Context]:
    """After update ``version`` consumed ``results`` (version, member, fitness): the parents of
    ``version + 1``, returned."""
    scores: dict[tuple[int, int], list[float]] = {}
    for v, m, f in results:
      scores.setdefault((v, m // 2), []).append(float(f))
    ranked = sorted(scores, key=lambda k: (-sum(scores[k]) / len(scores[k]), k))
    chosen: list[Context] = []
    for v, pair in ranked:
      c = self.context(v, 2 * pair)
      if c not in chosen:
        chosen.append(c)
      if len(chosen) == self.num_parents:
        break
    self._parents[version + 1] = chosen or list(self.parents(version))
    return self._parents[version + 1]

  def forget(self, oldest: int) -> None:
    """Drop the parents of versions before ``oldest`` (with a bound K: the version now due minus
    K; no result of an older version can still be consumed). The newest are always kept."""
    newest = max(self._parents)
    self._parents = {v: p for v, p in self._parents.items() if v >= oldest or v == newest}

  def state_dict(self) -> dict[str, Any]:
    # The pieces too: a context is indices into them, meaningless under another library.
    return {"seed": self.seed, "parents": self.num_parents, "pieces": list(self.library.pieces),
            "by_version": [[v, [list(c) for c in ps]] for v, ps in sorted(self._parents.items())]}

  @classmethod
  def from_state_dict(cls, library: ContextLibrary, state: dict[str, Any]) -> "Coevolution":
    if "pieces" in state and tuple(state["pieces"]) != library.pieces:
      raise ValueError("coevolution: the stored contexts index another library of prompt pieces "
                       "than this one (keep the run's coevolve.pieces, or start fresh)")
    co = cls(library, state["seed"], state["parents"])
    co._parents = {v: [tuple(c) for c in ps] for v, ps in state["by_version"]}
    return co

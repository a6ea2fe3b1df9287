"""Parameter–context co-evolution: seeded contexts per pair, mutation bounds, the best contexts
carried forward, exact restore."""
import random

import pytest

from jaxes.controller.coevolve import Coevolution, ContextLibrary

LIB = ContextLibrary(("Think before each command.", "Check the file exists first.",
                      "Prefer one command per turn.", "Read the task twice.",
                      "Finish with <action>done</action>."), max_pieces=3)


def test_mutation_stays_within_the_library_and_its_length():
  rng, parent = random.Random(0), ()
  seen = set()
  for _ in range(300):
    child = LIB.mutate(parent, rng)
    assert len(child) <= 3 and len(set(child)) == len(child)
    assert all(0 <= i < len(LIB.pieces) for i in child)
    assert abs(len(child) - len(parent)) <= 1 and child != parent
    seen.add(child)
    parent = child
  assert len(seen) > 20
  assert ContextLibrary(("only",), max_pieces=1).mutate((0,), rng) == ()   # dropping is all it can do


def test_contexts_are_seeded_per_pair_and_shared_by_partners():
  a, b = Coevolution(LIB, seed=1), Coevolution(LIB, seed=1)
  ctx = [a.context(0, m) for m in range(8)]
  assert ctx == [b.context(0, m) for m in range(8)]
  assert all(ctx[2 * j] == ctx[2 * j + 1] for j in range(4))
  assert len(set(ctx)) > 1 and a.context(0, -1) == ()
  assert Coevolution(LIB, seed=2).context(0, 0) != ctx[0] or Coevolution(LIB, seed=2).context(0, 2) != ctx[2]
  assert a.prompt(0, 0) == "\n".join(LIB.pieces[i] for i in ctx[0])


def test_best_contexts_are_carried_forward_and_restored_exactly():
  co = Coevolution(LIB, seed=3, parents=2)
  ctx = {m: co.context(0, m) for m in range(8)}
  # Pair 2 scores best, then pair 0; pair 1's contexts differ from both.
  results = [(0, m, {0: 0.5, 1: 0.1, 2: 0.9, 3: 0.0}[m // 2]) for m in range(8)]
  parents = co.update(0, results)
  expected = [ctx[4]] + [c for c in (ctx[0], ctx[2], ctx[6]) if c != ctx[4]][:1]
  assert parents == expected and co.context(1, -1) == ctx[4]
  restored = Coevolution.from_state_dict(LIB, co.state_dict())
  assert [restored.context(1, m) for m in range(8)] == [co.context(1, m) for m in range(8)]
  assert co.update(1, []) == parents   # a cohort without results keeps its parents
  co.forget(oldest=2)
  with pytest.raises(KeyError, match="version 0"):
    co.context(0, 0)


def test_bad_library_is_one_line():
  with pytest.raises(ValueError, match="non-empty prompt piece"):
    ContextLibrary(("ok", "  "))

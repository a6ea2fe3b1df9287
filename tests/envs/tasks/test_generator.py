"""Procedural tasks: determinism, disjoint splits, stdlib-only tests, oracle 100% / noop 0%."""
import ast
import sys

import pytest

from jaxes.envs import make_sandbox
from jaxes.envs.check import run_checks, summarize
from jaxes.envs.tasks import generator
from jaxes.envs.tasks.families import files, scripts, text

ALL = [(f, d) for f in generator.FAMILIES for d in generator.DIFFICULTIES]


def test_at_least_twelve_families():
  assert len(generator.FAMILIES) >= 12
  assert len(set(generator.FAMILIES)) == len(generator.FAMILIES)
  # Each family is one maker in exactly one of the family modules (files, text, scripts).
  homes = {f: [m.__name__ for m in (files, scripts, text) if callable(getattr(m, f, None))]
           for f in generator.FAMILIES}
  assert all(len(h) == 1 for h in homes.values()), homes


@pytest.mark.parametrize("family,difficulty", ALL)
def test_deterministic_and_seed_dependent(family, difficulty):
  a = generator.generate(family, 7, difficulty)
  assert a == generator.generate(family, 7, difficulty)
  others = [generator.generate(family, s, difficulty) for s in (8, 9, 10)]
  assert any(o.instruction != a.instruction or o.files != a.files for o in others)
  assert (a.family, a.difficulty, a.seed) == (family, difficulty, 7)


@pytest.mark.parametrize("family,difficulty", ALL)
def test_paths_under_home_and_stdlib_only_tests(family, difficulty):
  task = generator.generate(family, 3, difficulty)
  assert all(path.startswith("/home/user/") for path, _ in task.files)
  assert task.solution and task.final_tests and "/home/user" in task.instruction
  tree = ast.parse(task.final_tests)
  imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
              for a in n.names}
  imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
  assert imported <= set(sys.stdlib_module_names), imported
  assert any(isinstance(n, ast.FunctionDef) and n.name.startswith("test_") for n in tree.body)


def test_splits_disjoint_and_reproducible():
  train = generator.split("train", 200)
  heldout = generator.split("heldout", 200)
  assert train == generator.split("train", 200)
  assert {(t.family, t.seed) for t in train}.isdisjoint({(t.family, t.seed) for t in heldout})
  content = lambda t: (t.instruction, t.files, t.final_tests)
  assert {content(t) for t in train}.isdisjoint({content(t) for t in heldout})
  assert {t.family for t in train} == set(generator.FAMILIES)
  assert {t.difficulty for t in train} == set(generator.DIFFICULTIES)
  assert generator.split("train", 5, seed=1) != generator.split("train", 5, seed=0)


def test_bad_arguments_name_the_problem():
  with pytest.raises(ValueError, match="unknown task family 'nope'"):
    generator.generate("nope", 0)
  with pytest.raises(ValueError, match="difficulty=4"):
    generator.generate("create_file", 0, 4)
  with pytest.raises(ValueError, match="split='dev'"):
    generator.split("dev", 3)


@pytest.fixture(scope="module")
def sandbox():
  sb = make_sandbox("local")
  yield sb
  sb.shutdown()


@pytest.mark.parametrize("agent,want_passed", [("oracle", True), ("noop", False)])
def test_oracle_solves_every_family_and_noop_none(sandbox, agent, want_passed):
  tasks = [generator.generate(f, 11, d) for f, d in ALL]
  results, leaked = run_checks(sandbox, tasks, agent, workers=2, progress=False)
  wrong = [t.name for t, o in results if o.passed != want_passed]
  assert not wrong, f"{agent}: unexpected outcome on {wrong}"
  assert leaked == 0
  summary = summarize(results, leaked)
  assert summary["pass_rate"] == (1.0 if want_passed else 0.0)

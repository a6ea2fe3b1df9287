"""Test-suite set-up: 8 host CPU devices so multi-device sharding is exercised on any machine, and
one persistent XLA compilation cache for the whole session, and the longest test files first.

Many tests build the same tiny programs again in a new object or a new process (a resumed
trainer, a rerun after SIGKILL, the processes of a multi-host run); the cache makes every
compilation after the first a file read, which halves those tests. It starts empty in a fresh
directory (removed at exit), so no run depends on an earlier one; a caller's own
``JAX_COMPILATION_CACHE_DIR`` wins. Subprocesses inherit it through the environment, and so do
pytest-xdist's workers (the README runs the suite on two): they share one cache.

The README's ``-n 2 --dist loadfile --no-loadscope-reorder`` hands whole files to the two workers
in collection order (xdist's own order is by test count, which put the slowest files last);
starting with the files that take minutes (multi-process runs, kill-and-resume, 8-device
compiles) keeps one worker from finishing them alone at the end. Order within a file is kept.
"""
import atexit
import os
import pathlib
import shutil
import sys
import tempfile

# Test modules live in packages that mirror jaxes/ (tests/rollout/test_engine.py, ...); the
# shared helpers (helpers_*.py) stay here, importable by name from any depth.
TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Backend optimisation off for the suite's own processes: the tests check what programs compute
# (tokens, bits across layouts, shapes, memory), not how fast; at level 0 XLA:CPU compiles the
# engine tests' programs with ~35% less CPU (tests/rollout/test_pages.py: 150 vs 235 CPU-s). The
# processes the tests launch inherit these flags (helpers_train.launch_env keeps them and sets
# its own device count): test_multihost_train + test_grpo_multihost 457 -> 262 CPU-s. Both sides
# of a process-layout comparison compile the same per-device program with the same flags.
# XLA:CPU's older loop emitters instead of its MLIR fusion emitters, likewise for the suite alone:
# the same programs compile with ~40% less CPU (tests/rollout/test_pages.py: 142 vs 83 CPU-s,
# tests/rl/test_grpo.py -k teacher_forced: 34 vs 19), and every test passes either way.
# One LLVM module per program (no split for parallel codegen): on a machine whose cores the two
# test workers already keep busy, splitting only adds work (tests/rollout/test_pages.py +
# test_engine_sharded.py: 103.6 -> 95.6 CPU-s, the same tests pass; 2026-12-05).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
                      " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="pytest-xla-cache-")  # not "jaxes-": sandbox leak checks look for those
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  # Cache every program that takes 0.1 s or more to compile (the tests' models are tiny, so
  # that is most of the engine's and trainer's programs, and JAX's default of 1 s would skip
  # them). Below it, writing an entry costs about what compiling again does: the eager ops of
  # tests/rl/test_grpo.py + test_engine_ragged.py, 608 entries, took 32.5 s with every program
  # cached, 30.1 s with this threshold and 29.6 s with no cache (2026-12-05). The processes the
  # tests launch keep caching everything (helpers_train.launch_env): their reruns read it back.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

import helpers_components  # noqa: E402
import helpers_timings  # noqa: E402
# Compile vs run time per test (build/test-timings.json, and a table at the end of the run).
from helpers_timings import (pytest_runtest_protocol, pytest_sessionfinish,  # noqa: E402,F401
                             pytest_terminal_summary)


def pytest_configure(config):
  # One marker per optional component (tests/helpers_components.py), declared here only.
  for name, (what, _, _) in helpers_components.COMPONENTS.items():
    config.addinivalue_line("markers", f"{name}: needs {what} (skipped, naming how to get it, without)")
  helpers_timings.pytest_configure(config)


@pytest.hookimpl(tryfirst=True)   # before fixtures set up (the docker ones reach the engine)
def pytest_runtest_setup(item):
  for mark in item.iter_markers():
    if mark.name in helpers_components.COMPONENTS and not helpers_components.present(mark.name):
      pytest.skip(helpers_components.how_to_get(mark.name))


# The files that took longest in CI (benchmarks of the suite: `--durations` at the end of a run),
# as paths below tests/. A scheduling hint only: a file missing here just runs in its usual place.
LONGEST_FILES = ("train/test_trainer.py", "train/test_trainer_staleness.py",
                 "rollout/test_engine_sharded.py", "rollout/test_pages.py",
                 "rollout/test_policy_bank.py", "train/algorithms/test_sao.py",
                 "experiments/test_grid.py", "train/test_state.py", "test_preflight.py",
                 "envs/sandboxes/test_docker_sandbox.py", "envs/images/test_task_images.py",
                 "rollout/test_engine_fullrank_slices.py", "rl/test_grpo.py",
                 "envs/test_security.py", "train/test_coevolution.py",
                 "train/algorithms/test_grpo.py", "rollout/test_engine_prefill_hold.py",
                 "train/test_run_dir.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  for item in items:   # the end-to-end tier: everything under tests/end_to_end/, and marked tests
    if "end_to_end" in item.path.relative_to(TESTS).parts:
      item.add_marker(pytest.mark.end_to_end)
  # stable: file order kept
  items.sort(key=lambda item: rank.get(item.path.relative_to(TESTS).as_posix(), len(rank)))

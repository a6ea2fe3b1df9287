"""Final-test cost of the current verifier against an earlier one, interleaved on one handle.

  PYTHONPATH=. python benchmarks/verifier_cost.py --before main --backends local docker --n 7

The earlier verifier is ``jaxes/envs/tasks/final_tests.py`` at git revision ``--before``, loaded
as a module of its own and swapped in for the sandbox's between runs, so both time the same
handle, files and machine state. Two test files: a plain 2-test file (reads files only) and the
same tests importing the agent's ``solution.py`` (issue 66: the current verifier then starts the
agent-code server). Prints the median seconds of ``run_tests`` per backend, file and verifier.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time

from jaxes.envs import make_sandbox
from jaxes.envs.sandboxes import docker_sandbox, local_sandbox
from jaxes.envs.tasks import final_tests
from jaxes.envs.tasks.task import Task

PLAIN = ("def test_answer():\n  assert open('/home/user/answer.txt').read() == '42'\n\n"
         "def test_total():\n  assert open('/home/user/total.txt').read() == '6'\n")
IMPORTING = ("import importlib.util\n"
             "spec = importlib.util.spec_from_file_location('solution', '/home/user/solution.py')\n"
             "solution = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(solution)\n\n"
             "def test_answer():\n  assert solution.answer() == 42\n\n"
             "def test_total():\n  assert solution.total([1, 2, 3]) == 6\n")
SOLVE = ("printf 42 > answer.txt; printf 6 > total.txt; printf 'def answer():\\n  return 42\\n"
         "def total(xs):\\n  return sum(xs)\\n' > solution.py")


def module_at(revision: str):
  source = subprocess.run(["git", "show", f"{revision}:jaxes/envs/tasks/final_tests.py"],
                          capture_output=True, text=True, check=True).stdout
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(f"final_tests_{revision}", f.name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--before", default="main")
  ap.add_argument("--backends", nargs="+", default=["local", "docker"])
  ap.add_argument("--n", type=int, default=7)
  args = ap.parse_args()
  verifiers = {args.before: module_at(args.before), "now": final_tests}
  for backend in args.backends:
    backend_module = local_sandbox if backend == "local" else docker_sandbox
    sandbox = make_sandbox(backend)
    try:
      for label, tests in (("plain", PLAIN), ("imports solution.py", IMPORTING)):
        times = {name: [] for name in verifiers}
        with sandbox.start(Task(name="cost", instruction="x", final_tests=tests)) as handle:
          handle.exec(SOLVE, 10)
          for _ in range(args.n):
            for name, module in verifiers.items():   # interleaved: drift hits both alike
              backend_module.final_tests = module
              t0 = time.perf_counter()
              report = handle.run_tests()
              times[name].append(time.perf_counter() - t0)
              assert report.passed, (name, report.report[-2000:])
        backend_module.final_tests = final_tests
        medians = {name: statistics.median(v) for name, v in times.items()}
        print(f"{backend:6s} {label:20s} " + "  ".join(
          f"{name} {1000 * m:.0f} ms" for name, m in medians.items()) +
          f"  ({medians['now'] / medians[args.before]:.2f}x, median of {args.n})", flush=True)
    finally:
      backend_module.final_tests = final_tests
      sandbox.shutdown()


if __name__ == "__main__":
  sys.exit(main())

"""Sandbox latency: episode start (with setup), command exec, final tests, close.

  python benchmarks/sandbox_latency.py --backend docker --n 50
  python benchmarks/sandbox_latency.py --backend local,docker,docker-pool --n 50  # one run
  (docker-pool = the docker backend with a warm pool of --pool-size containers)

Episodes run one after another (no concurrency), after two warm-up episodes. Prints a table of
median and p95 milliseconds per backend and, last, one JSON line with every number.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxes.envs import make_sandbox
from jaxes.envs.tasks.task import Task

TASK = Task(
  name="latency", instruction="Count ERROR lines of logs/app.log into count.txt.",
  files=(("/home/user/logs/app.log", b"ERROR a\nINFO b\nERROR c\n" * 50),),
  setup="mkdir -p /home/user/out && cp /home/user/logs/app.log /home/user/out/copy.log",
  final_tests=("def test_count():\n  assert open('/home/user/count.txt').read().strip() == '100'\n\n"
               "def test_copy():\n  assert open('/home/user/out/copy.log').read().count('INFO') == 50\n"))
COMMANDS = ("ls -la", "grep -c ERROR logs/app.log > count.txt", "cat count.txt")


def percentile(values: list[float], q: float) -> float:
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(config: str, n: int, pool_size: int) -> dict:
  backend = "docker" if config == "docker-pool" else config
  pool_size = pool_size if config == "docker-pool" else 0
  sandbox = make_sandbox(backend, **({"pool_size": pool_size} if pool_size else {}))
  times = {"start": [], "exec": [], "tests": [], "close": []}
  try:
    if pool_size:
      time.sleep(5.0)   # let the pool fill before measuring
    for episode in range(n + 2):
      t0 = time.perf_counter()
      handle = sandbox.start(TASK)
      t1 = time.perf_counter()
      execs = []
      for command in COMMANDS:
        s = time.perf_counter()
        result = handle.exec(command, 10.0)
        execs.append(time.perf_counter() - s)
        if result.exit_code != 0:
          raise RuntimeError(f"{config}: `{command}` failed: {result.output}")
      t2 = time.perf_counter()
      report = handle.run_tests()
      t3 = time.perf_counter()
      handle.close()
      t4 = time.perf_counter()
      if not report.passed:
        raise RuntimeError(f"{config}: final tests failed: {report.report}")
      if episode >= 2:   # warm-up episodes excluded
        times["start"].append(t1 - t0)
        times["exec"].extend(execs)
        times["tests"].append(t3 - t2)
        times["close"].append(t4 - t3)
  finally:
    sandbox.shutdown()
  stats = {"backend": config, "episodes": n, "pool_size": pool_size,
           "leftovers_after_shutdown": sandbox.leftovers()}
  for phase, values in times.items():
    stats[phase] = {"median_ms": round(1e3 * statistics.median(values), 1),
                    "p95_ms": round(1e3 * percentile(values, 0.95), 1)}
  return stats


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--backend", default="docker",
                      help="local, docker, docker-pool, or a comma list run side by side")
  parser.add_argument("--n", type=int, default=50, help="measured episodes per backend")
  parser.add_argument("--pool-size", type=int, default=4, help="warm pool size of docker-pool")
  args = parser.parse_args()
  results = [measure(b.strip(), args.n, args.pool_size) for b in args.backend.split(",")]
  print(f"{'backend':<12} {'phase':<6} {'median ms':>10} {'p95 ms':>10}")
  for stats in results:
    for phase in ("start", "exec", "tests", "close"):
      print(f"{stats['backend']:<12} {phase:<6} {stats[phase]['median_ms']:>10.1f} "
            f"{stats[phase]['p95_ms']:>10.1f}")
  print(json.dumps({"benchmark": "sandbox_latency", "results": results}))


if __name__ == "__main__":
  main()

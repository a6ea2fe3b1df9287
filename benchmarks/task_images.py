"""Task-built images (issue 35): build time cold vs cached, and episode latency of a task run
in its own image vs the same folder translated into the shared image, side by side.

  PYTHONPATH=. python benchmarks/task_images.py [--suite tests/task_suites] [--episodes 10]

Cold: every folder copied with a fresh salt file (a new content hash) and built without the
engine's layer cache; cached: the same folders loaded again by a new builder (no build).
Episodes: the oracle, alternating translated / as-written episodes on one docker sandbox.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid

from jaxes.envs import check, protocol
from jaxes.envs.images.task_images import TaskImageBuilder
from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox
from jaxes.envs.tasks import loaders


def salted_copy(suite: str, into: str) -> str:
  salt = uuid.uuid4().hex
  for name in os.listdir(suite):
    folder = os.path.join(suite, name)
    if not loaders.task_format(folder):
      continue
    target = os.path.join(into, name)
    shutil.copytree(folder, target)
    definition = os.path.join(target, "container.def")
    if os.path.exists(definition):   # a comment in %post: a new post script, a new hash
      with open(definition) as f:
        text = f.read()
      with open(definition, "w") as f:
        f.write(text.replace("%post\n", f"%post\n    # salt {salt}\n", 1))
    else:                            # a file in the build context: a new hash
      with open(os.path.join(target, "environment", ".salt"), "w") as f:
        f.write(salt)
  return into


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--suite", default="tests/task_suites")
  ap.add_argument("--episodes", type=int, default=10)
  args = ap.parse_args()
  logs = tempfile.mkdtemp(prefix="jaxes-bench-logs-")
  with tempfile.TemporaryDirectory() as tmp:
    suite = salted_copy(args.suite, tmp)
    cold = TaskImageBuilder(log_dir=logs, rebuild=True, network="none")
    t0 = time.monotonic()
    built = loaders.load_tasks(suite, builder=cold)
    cold_s = time.monotonic() - t0
    cached = TaskImageBuilder(log_dir=logs, network="none")
    t0 = time.monotonic()
    loaders.load_tasks(suite, builder=cached)
    cached_s = time.monotonic() - t0
    assert not any(result.built for _, result in cached.builds)
    print(f"build, {len(built)} folders: cold {cold_s:.2f} s (per task "
          + ", ".join(f"{n} {r.seconds:.2f} s" for n, r in cold.builds)
          + f"); cached load {cached_s:.3f} s; ratio {cold_s / cached_s:.0f}x")
    translated = {t.name: t for t in loaders.load_tasks(suite)}
    sandbox = DockerSandbox(run_label=f"bench-task-images-{uuid.uuid4().hex[:8]}")
    oracle = check.make_agent("oracle")
    try:
      for task in built:
        times = {"translated": [], "as written": []}
        passed = {"translated": 0, "as written": 0}
        for _ in range(args.episodes):
          for mode, t in (("translated", translated[task.name]), ("as written", task)):
            t0 = time.monotonic()
            outcome = protocol.run_episode(sandbox, t, oracle(t))
            times[mode].append(time.monotonic() - t0)
            passed[mode] += outcome.passed
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"{task.name}: episode median translated/shared image {med['translated']:.2f} s "
              f"(oracle {passed['translated']}/{args.episodes}), as written/own image "
              f"{med['as written']:.2f} s (oracle {passed['as written']}/{args.episodes}); "
              f"own/shared {med['as written'] / med['translated']:.2f}x")
    finally:
      sandbox.shutdown()
      for _, result in cold.builds:
        try:
          cold.client.images.remove(result.tag)
        except Exception:   # noqa: BLE001  (already gone: nothing to clean)
          pass
  shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
  main()

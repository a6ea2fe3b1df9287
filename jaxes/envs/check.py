"""Runs every task with a fixed agent and reports pass rates, failures and leftovers.

  python -m jaxes.envs.check --backend local --generated 140 --agent oracle
  python -m jaxes.envs.check --backend docker --tasks DIR --agent noop --workers 4
  python -m jaxes.envs.check --backend docker --tasks DIR --agent oracle --attempts 3

Task folders (--tasks) run as their authors wrote them on the docker backend: each folder's
recipe is built into its own image (cached by a content hash of the folder; --rebuild forces)
and a Harbor tests/test.sh is its verifier (--task-build docker, the default there); with
--task-build translate (the default on the local backend) they are translated into the shared
sandbox image instead, and a line says so. With --tasks, a per-task table gives pass@attempts,
build seconds and mean episode seconds, as Harbor's job summary does, and names every task the
oracle failed.

Agents: ``oracle`` sends the task's reference solution as one command, then done; ``noop``
answers done at once; ``replay:FILE`` plays a JSON list of raw model outputs as the turns (or a
JSON object mapping task names to such lists), then done. The oracle must pass every generated
task and noop none (a task noop passes is broken). The last line printed is one JSON object:
{"tasks", "episodes", "passed", "pass_rate", "pass_at_attempts", "failures": {reason: count},
"excluded": {kind: count}, "tests_run_agent_code": [task], "leaked"} (episodes, passed,
pass_rate, failures and excluded -- the failures training leaves out of fitness -- count
episodes; pass_at_attempts is the share of tasks passed in at least one of their --attempts;
tests_run_agent_code names the tasks whose tests import or execute files from the agent's home;
the modules they import run in a process of the agent's own, apart from the verdict; with
--allow-unsafe-verdicts, "unsafe_verdicts" names the kept tasks whose verdict the agent's code
could decide, which are otherwise refused at loading, one line each). Exit status 1 when
anything leaked, or the oracle missed / noop passed a task; 2 (with one line saying why) when a
task folder cannot be loaded, the sandbox cannot start, or its engine stops answering (the
summary is printed first, with "leaked": null).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import sys
from typing import Callable

import tqdm

from jaxes.envs import BACKENDS, make_sandbox, protocol
from jaxes.envs.checking import exit_status, read_replay
from jaxes.envs.images.task_images import DEFAULT_MAX_IMAGE_MB
from jaxes.envs.sandboxes.sandbox import SandboxError
from jaxes.envs.tasks import generator
from jaxes.envs.tasks.task import Task, unsafe_task_names

DONE = "<action>done</action>"
FAILED_TESTS = "FAILED_TESTS"     # the episode ran normally but the final tests failed
NO_SOLUTION = "NO_SOLUTION"       # oracle asked for a task that has none
TASK_ERROR = "TASK_ERROR"         # the backend cannot run this task (e.g. files outside /home/user)


def make_agent(spec: str) -> Callable[[Task], Callable[[list], str] | None]:
  """Maps an --agent spec to a factory: task -> agent(messages) -> model text (None: no oracle)."""
  if spec == "noop":
    return lambda task: lambda messages: DONE
  if spec == "oracle":
    def oracle(task: Task):
      if task.solution is None:
        return None
      turns = iter([f"<command>{task.solution}</command>"])
      return lambda messages: next(turns, DONE)
    return oracle
  if spec.startswith("replay:"):
    data = read_replay(spec, "task")

    def replay(task: Task):
      outputs = data if isinstance(data, list) else data.get(task.name, [])
      turns = iter(outputs)
      return lambda messages: next(turns, DONE)
    return replay
  raise SystemExit(f"--agent {spec!r}: expected oracle, noop or replay:FILE")


def descendant_processes() -> int:
  """Live processes descended from this one (leaks of a sandbox that forgot to reap)."""
  return len(descendant_pids())


def descendant_pids() -> set[int]:
  """The process ids descended from this one (zombies included: a child not yet reaped)."""
  children = collections.defaultdict(list)
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    children[int(fields[1])].append(int(entry))
  todo, found = [os.getpid()], set()
  while todo:
    for child in children.get(todo.pop(), ()):
      found.add(child)
      todo.append(child)
  return found


def run_checks(sandbox, tasks: list[Task], agent_spec: str, workers: int = 1,
               progress: bool = True, attempts: int = 1,
               ) -> tuple[list[tuple[Task, protocol.EpisodeOutcome | str]], int | None]:
  """Plays every task ``attempts`` times; returns (task, outcome or the reason it could not be
  played) pairs, in task order, and the number of leftovers (None: the sandbox could not say,
  its engine gone)."""
  factory = make_agent(agent_spec)
  # Only what the episodes leave counts: a caller (a test process, a notebook) may have children
  # of its own that are none of the check's business.
  before = descendant_pids()

  def one(task: Task):
    agent = factory(task)
    if agent is None:
      return task, NO_SOLUTION
    try:
      return task, protocol.run_episode(sandbox, task, agent)
    except ValueError as e:
      print(f"{task.name}: {e}", file=sys.stderr)
      return task, TASK_ERROR

  results = []
  with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
    futures = [pool.submit(one, t) for t in tasks for _ in range(attempts)]
    for fut in tqdm.tqdm(concurrent.futures.as_completed(futures), total=len(futures),
                         disable=not progress, desc="episodes", file=sys.stderr):
      results.append(fut.result())
  try:
    leaked = sum(sandbox.leftovers().values()) + len(descendant_pids() - before)
  except SandboxError as err:   # the engine is gone: what leaked cannot be known
    print(f"check: cannot count leftovers: {err}", file=sys.stderr)
    leaked = None
  order = {t.name: i for i, t in enumerate(tasks)}
  results.sort(key=lambda r: order[r[0].name])
  return results, leaked


def summarize(results, leaked: int) -> dict:
  failures = collections.Counter()
  for _task, outcome in results:
    if isinstance(outcome, str):
      failures[outcome] += 1
    elif not outcome.passed:
      failures[outcome.failure or FAILED_TESTS] += 1
  passed = sum(not isinstance(o, str) and o.passed for _t, o in results)
  by_task = collections.defaultdict(bool)
  tests_run_agent_code = {}
  for task, outcome in results:
    by_task[task.name] |= not isinstance(outcome, str) and outcome.passed
    tests_run_agent_code[task.name] = task.tests_run_agent_code
  return {"tasks": len(by_task), "episodes": len(results), "passed": passed,
          "pass_rate": passed / len(results) if results else 0.0,
          "pass_at_attempts": sum(by_task.values()) / len(by_task) if by_task else 0.0,
          "failures": dict(sorted(failures.items())),
          # What training would leave out of fitness (infrastructure failures), by kind; every
          # other failure, SANDBOX_BROKEN included, is a failed episode that counts.
          "excluded": {k: n for k, n in sorted(failures.items()) if k in protocol.EXCLUDED},
          # Tasks whose tests run the agent's code (each in a process of its own).
          "tests_run_agent_code": sorted(n for n in by_task if tests_run_agent_code[n]),
          "leaked": leaked}


def task_table(results, builds: dict | None = None) -> str:
  """Per task: attempts, passes, pass@attempts, image build seconds ("cached" when none was
  needed, "-" for the shared image), mean episode seconds (container start to close) and
  whether its tests run the agent's code (``Task.tests_run_agent_code``: a pass there is no
  proof)."""
  rows: dict[str, list] = {}
  for task, outcome in results:
    row = rows.setdefault(task.name, [0, 0, 0.0, task.tests_run_agent_code])
    row[0] += 1
    if not isinstance(outcome, str):
      row[1] += outcome.passed
      row[2] += outcome.timings.get("start_s", 0.0) + outcome.timings.get("total_s", 0.0)
  width = max([len(name) for name in rows] + [4])
  lines = [f"{'task':<{width}} {'attempts':>8} {'passed':>6} {'pass@n':>6} {'build_s':>8} "
           f"{'episode_s':>9} {'agent_code':>10}"]
  for name, (n, passed, seconds, agent_code) in rows.items():
    built = (builds or {}).get(name)
    build = "-" if built is None else f"{built.seconds:.1f}" if built.built else "cached"
    lines.append(f"{name:<{width}} {n:>8} {passed:>6} {int(passed > 0):>6} {build:>8} "
                 f"{seconds / n:>9.2f} {'yes' if agent_code else '-':>10}")
  return "\n".join(lines)


def oracle_failures(results) -> list[str]:
  """'name (k/n attempts)' for every task the oracle did not pass every time."""
  counts: dict[str, list[int]] = {}
  for task, outcome in results:
    row = counts.setdefault(task.name, [0, 0])
    row[1] += 1
    row[0] += not isinstance(outcome, str) and outcome.passed
  return [f"{name} ({n - k}/{n} attempts failed)" for name, (k, n) in counts.items() if k < n]


def family_table(results) -> str:
  rows = collections.defaultdict(lambda: [0, 0, 0, collections.Counter()])
  for task, outcome in results:
    row = rows[task.family]
    row[0] += 1
    if isinstance(outcome, str):
      row[3][outcome] += 1
    else:
      row[1] += outcome.passed
      row[2] += outcome.turns
      if not outcome.passed:
        row[3][outcome.failure or FAILED_TESTS] += 1
  lines = [f"{'family':<16} {'tasks':>5} {'passed':>6} {'rate':>6} {'turns':>5}  failures"]
  for family in sorted(rows):
    n, p, turns, fails = rows[family]
    fail_text = ", ".join(f"{k}={v}" for k, v in sorted(fails.items())) or "-"
    lines.append(f"{family:<16} {n:>5} {p:>6} {p / n:>6.0%} {turns / n:>5.1f}  {fail_text}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  env = argparse.ArgumentParser(add_help=False)
  env.add_argument("--env", choices=("terminal", "webshop"), default="terminal")
  env_args, argv = env.parse_known_args(sys.argv[1:] if argv is None else argv)
  if env_args.env == "webshop":   # WebShop goals: its own options (see jaxes.envs.webshop.check)
    from jaxes.envs.webshop import check as webshop_check
    return webshop_check.main(argv)
  ap = argparse.ArgumentParser(prog="python -m jaxes.envs.check", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--env", choices=("terminal", "webshop"), default="terminal",
                  help="terminal tasks (these options) or WebShop goals (--env webshop --help)")
  ap.add_argument("--backend", choices=BACKENDS, default="local")
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--generated", type=int, metavar="N", help="N generated tasks")
  src.add_argument("--tasks", metavar="DIR", help="a folder of Endless Terminals / "
                   "Terminal-Bench task folders")
  ap.add_argument("--split", choices=generator.SPLITS, default="train")
  ap.add_argument("--seed", type=int, default=0, help="split seed for --generated")
  ap.add_argument("--agent", default="oracle", help="oracle | noop | replay:FILE")
  ap.add_argument("--workers", type=int, default=1)
  ap.add_argument("--attempts", type=int, default=1, metavar="N",
                  help="episodes per task (pass@N, as Harbor's n_attempts)")
  ap.add_argument("--task-build", choices=("auto", "docker", "translate"), default="auto",
                  help="--tasks: build each folder's own image (docker) or translate it into "
                  "the shared image; auto: docker on the docker backend")
  ap.add_argument("--rebuild", action="store_true",
                  help="--task-build docker: rebuild task images even when cached")
  ap.add_argument("--build-network", default="none", metavar="MODE",
                  help="--task-build docker: the network the recipes' RUN steps get (default "
                  "none; 'default' or 'bridge' for suites that install packages as they build)")
  ap.add_argument("--max-image-mb", type=int, default=DEFAULT_MAX_IMAGE_MB, metavar="MB",
                  help="--task-build docker: refuse a task image larger than this "
                  f"(default {DEFAULT_MAX_IMAGE_MB})")
  ap.add_argument("--pytest", action="store_true", help="local backend: run final tests with "
                  "real pytest instead of the light runner")
  ap.add_argument("--isolation", choices=("auto", "bwrap", "unshare", "none"), default="auto",
                  help="local backend: bubblewrap (auto), or for a manual check only the weak "
                  "unshare / none mechanisms (warned about; never used for training)")
  ap.add_argument("--verifier-network", metavar="NAME", help="docker backend: the docker "
                  "network a Harbor test.sh joins once the agent's processes are gone (for "
                  "tests that install their tools at test time; default: none)")
  ap.add_argument("--allow-unsafe-verdicts", action="store_true",
                  help="--tasks: keep task folders whose verdict the agent's code could decide "
                  "(final_tests.unsafe_verdict; refused by default, one line each); the summary "
                  "lists them")
  ap.add_argument("--no-progress", action="store_true")
  args = ap.parse_args(argv)
  if args.generated is not None and args.generated < 1:
    ap.error("--generated must be at least 1")
  if args.attempts < 1:
    ap.error("--attempts must be at least 1")
  task_build = args.task_build
  if task_build == "auto":
    task_build = "docker" if args.backend == "docker" else "translate"
  if args.tasks and task_build == "docker" and args.backend != "docker":
    print("check: --task-build docker: task-built images run on the docker backend only "
          "(--backend docker)", file=sys.stderr)
    return 2

  try:
    make_agent(args.agent)   # fail on a bad --agent before starting anything: a set-up error
  except SystemExit as e:
    print(f"check: {e}", file=sys.stderr)
    return 2
  builder = None
  if args.tasks:
    from jaxes.envs.tasks.loaders import TaskLoadError, load_tasks
    from jaxes.envs.images.task_images import TaskImageBuilder, TaskImageError
    try:
      if task_build == "docker":
        builder = TaskImageBuilder(rebuild=args.rebuild, network=args.build_network,
                                   max_image_mb=args.max_image_mb)
      tasks = load_tasks(args.tasks, builder=builder,
                         allow_unsafe_verdicts=args.allow_unsafe_verdicts)
    except (TaskLoadError, TaskImageError) as e:
      print(f"check: {e}", file=sys.stderr)
      return 2
  else:
    tasks = generator.split(args.split, args.generated, seed=args.seed)
  kwargs = {}
  if args.verifier_network is not None:
    if args.backend != "docker":
      print("check: --verifier-network needs --backend docker", file=sys.stderr)
      return 2
    kwargs["verifier_network"] = args.verifier_network
  if args.backend == "local":
    kwargs = {"use_pytest": args.pytest, "isolation": args.isolation,
              "allow_weak_isolation": args.isolation in ("unshare", "none")}
  try:
    sandbox = make_sandbox(args.backend, **kwargs)
  except SandboxError as e:
    print(f"check: {e}", file=sys.stderr)
    return 2
  try:
    sandbox.check_verifier(tasks)
  except SandboxError as e:
    sandbox.shutdown()
    print(f"check: {e}", file=sys.stderr)
    return 2
  try:
    results, leaked = run_checks(sandbox, tasks, args.agent, args.workers, not args.no_progress,
                                 args.attempts)
  finally:
    sandbox.shutdown()
  summary = summarize(results, leaked)
  if args.allow_unsafe_verdicts:
    summary["unsafe_verdicts"] = unsafe_task_names(tasks)
  print(family_table(results))
  if args.tasks:
    print(task_table(results, dict(builder.builds) if builder else None))
  if args.agent == "oracle":
    for failed in oracle_failures(results):
      print(f"check: the oracle failed task {failed}", file=sys.stderr)
  print(json.dumps(summary))
  if leaked is None:
    print("check: the sandbox's engine stopped answering during the check; the summary above "
          "counts its episodes as SANDBOX_ERROR", file=sys.stderr)
    return 2
  return exit_status(args.agent, summary["passed"], summary["episodes"], leaked)


if __name__ == "__main__":
  sys.exit(main())

"""Compile a run's programs before it needs them: all of them, in parallel threads, with progress.

A run compiles its engine's programs lazily otherwise, one at a time, each when an episode first
needs it (minutes each for a 7B model). ``compile_all`` compiles lowered programs in a thread pool
(XLA's compilers release the GIL, so threads run compiles side by side) and reads each result in
its thread (the preflight reads the memory analysis; the trainer keeps nothing). The trainer's
``warm_up`` is that with a progress bar, over the engine's programs and the update's
(``run_programs``): its compiles land in the persistent compilation cache
(``compile_cache``), from which the run's own calls load them instead of compiling again — the same
place a restarted run, or every other process of an SPMD pod run, reads them from.

While compiling, XLA's log is watched for the GPU compiler's "could not rematerialise below the
device's memory" warning (the compiler does not fail such a program): each compiled program
carries the warning lines its thread logged.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import resource
import sys
import threading
import time
from typing import Any, Callable, Mapping

from tqdm import tqdm

from jaxes import xla_log


@dataclasses.dataclass
class Compiled:
  name: str
  result: Any                 # what ``read`` returned for the compiled program (None when it raised)
  seconds: float              # wall seconds of this program's compile
  error: BaseException | None = None
  remat_failures: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Compilation:
  programs: list[Compiled]    # in the order they were given
  wall_seconds: float
  cpu_seconds: float          # CPU time while compiling (all threads, and child processes)
  unattributed: list[str]     # remat warnings from a thread that compiled none of them

  @property
  def remat_failures(self) -> list[str]:
    return [line for p in self.programs for line in p.remat_failures] + self.unattributed


def _cpu_seconds() -> float:
  """This process's CPU time, all threads, and its finished children's (a compiler may run tools)."""
  return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                               resource.getrusage(resource.RUSAGE_CHILDREN)))


def compile_all(lowered: Mapping[str, Any], jobs: int = 1, read: Callable[[Any], Any] = lambda c: None,
                on_done: Callable[[Compiled], None] = lambda c: None) -> Compilation:
  """Compile each ``jax.stages.Lowered`` of ``lowered`` in up to ``jobs`` threads; ``read(compiled)``
  runs in the compiling thread and its value is kept (the executable itself is not, unless
  ``read`` returns it). A compile that raises is kept with its error; ``on_done`` sees each
  program as it finishes."""
  if jobs < 1:
    raise ValueError(f"jobs must be at least 1, got {jobs}")

  def one(name: str, program, log: xla_log.Watch) -> Compiled:
    start = time.perf_counter()
    try:
      out = Compiled(name, read(program.compile()), time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 -- kept for the caller, which decides what to raise
      out = Compiled(name, None, time.perf_counter() - start, e)
    log.mark(name)   # the warnings this thread logged since its previous program are this one's
    on_done(out)
    return out

  wall, cpu = time.perf_counter(), _cpu_seconds()
  with xla_log.watch(xla_log.REMAT_FAILED) as log:
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="compile") as pool:
      futures = [pool.submit(one, name, program, log) for name, program in lowered.items()]
      programs = [f.result() for f in futures]
  for p in programs:
    p.remat_failures = log.by_label.get(p.name, [])
  return Compilation(programs, time.perf_counter() - wall, _cpu_seconds() - cpu, log.unattributed)


def run_programs(engine, algorithm, state) -> Callable[[], dict]:
  """Every program a run compiles at start-up, for ``warm_up``: the engine's
  (``Engine.programs``) and its first update's (``update_programs``)."""
  return lambda: {**engine.programs(), **update_programs(algorithm, state)}


def update_programs(algorithm, state) -> dict:
  """The programs an update of ``state`` runs (``algorithm.update_lowerings``), lowered."""
  return {name: lower() for name, lower in algorithm.update_lowerings(state).items()}


def warm_up(programs: Callable[[], Mapping[str, Any]], jobs: int, log: Callable[[str], None] = print,
            progress: bool = True, file=None) -> Compilation | None:
  """Compile every program ``programs()`` lowers now, in ``jobs`` threads (0: not at all, each
  compiles when first called, and nothing is lowered: tracing every program is start-up work a
  lazy run does not need), with a progress bar ("compiling 12 programs: 5/12, 03:10"); one log
  line with the totals. Raises the first compile error (the run would meet it at that program's
  first call)."""
  if jobs < 0:
    raise ValueError(f"config.train.compile_jobs: must be >= 0 (0 = compile each program when "
                     f"first called), got {jobs}")
  if not jobs:
    return None
  lowered = programs()
  if not lowered:
    return None
  bar = tqdm(total=len(lowered), desc=f"compiling {len(lowered)} programs", leave=False,
             disable=not progress, file=file or sys.stderr,
             bar_format="{desc}: {n_fmt}/{total_fmt}, {elapsed}",
             mininterval=0, miniters=1)   # every program shown: a few dozen, minutes apart
  lock = threading.Lock()

  def done(_):
    with lock:
      bar.update(1)

  try:
    run = compile_all(lowered, jobs, on_done=done)
  finally:
    bar.close()
  for p in run.programs:
    if p.error is not None:
      raise p.error
  log(f"compiled {len(run.programs)} programs in {run.wall_seconds:.1f} s "
      f"({run.cpu_seconds:.0f} CPU-s, {jobs} thread(s))")
  return run

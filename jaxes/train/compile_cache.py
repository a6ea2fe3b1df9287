"""The persistent XLA compilation cache, on by default, so a rerun of a run starts without compiling.

A run's compiled programs are written under ``<workdir>/compile-cache``; a later start of the same
config (a resume, a restarted pod) reads them back instead of compiling again. An existing
``JAX_COMPILATION_CACHE_DIR`` (or ``jax_compilation_cache_dir`` already set in ``jax.config``) wins,
e.g. one directory on shared storage for every host of a pod: multi-process runs compile the same
SPMD programs on every process, so they hit the same entries. JAX's own cache is used as shipped
(its keys cover the program, the backend and the compiler flags); this module only picks the place, and (``watch``) tells which compiles the cache served.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import jax
from jax import monitoring

CACHE_SUBDIR = "compile-cache"


def cache_dir(workdir: str, environ=os.environ) -> str:
  """Where the run's compiled programs go: ``JAX_COMPILATION_CACHE_DIR`` when set, else
  ``<workdir>/compile-cache``."""
  return environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(os.path.abspath(workdir), CACHE_SUBDIR)


def enable(workdir: str) -> str:
  """Turns the persistent cache on for this process (unless a directory is configured already),
  for every program however quickly it compiles (unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
  says otherwise), and returns the directory in use. Call before the run's first compile: JAX
  picks the directory once."""
  # JAX leaves out programs compiled in under a second; a run's start-up is dozens of them (the
  # demo's steps each compile in about that), and a rerun should compile none.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  configured = jax.config.jax_compilation_cache_dir
  if configured:
    return configured
  path = cache_dir(workdir)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  return path


# JAX's monitoring events (jax/_src/compiler.py, dispatch.py): per compile, in its thread, a hit or
# a written entry, then the backend-compile duration naming the program.
CACHE_HIT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE = "/jax/compilation_cache/cache_misses"   # recorded as the compiled program is written
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class Compiles:
  """Every backend compile while ``watch`` was open, as (program, how) in finishing order: how is
  "read" (the persistent cache served it), "written" (compiled, then cached) or "compiled" (not
  cached: the cache is off or the program is under its size or time thresholds)."""
  programs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  seconds: list[float] = dataclasses.field(default_factory=list)   # each one's backend seconds

  def seconds_by_how(self, how: str) -> float:
    """Backend seconds of the compiles that went ``how`` ("read": the cache's loads)."""
    return sum(s for (_, h), s in zip(self.programs, self.seconds) if h == how)

  def of(self, name: str) -> list[str]:
    """How each compile of the program ``name`` (e.g. "jit(apply)") went."""
    return [how for program, how in self.programs if program == name]


@contextlib.contextmanager
def watch():
  """The compiles of this process (any thread) while open, with whether the cache served each:
  what tells a warm start-up from a cold one without timing anything."""
  seen, pending = Compiles(), threading.local()

  def on_event(event: str, **_):
    if event in (CACHE_HIT, CACHE_WRITE):
      pending.how = "read" if event == CACHE_HIT else "written"

  def on_duration(event: str, seconds: float, fun_name: str = "", **_):
    if event == BACKEND_COMPILE:
      seen.programs.append((fun_name, getattr(pending, "how", "compiled")))
      seen.seconds.append(seconds)
      pending.how = "compiled"

  monitoring.register_event_listener(on_event)
  monitoring.register_event_duration_secs_listener(on_duration)
  try:
    yield seen
  finally:
    monitoring.unregister_event_listener(on_event)
    monitoring.unregister_event_duration_listener(on_duration)

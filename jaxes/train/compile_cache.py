"""The persistent XLA compilation cache, on by default, so a rerun of a run starts without compiling.

A run's compiled programs are written under ``<workdir>/compile-cache``; a later start of the same
config (a resume, a restarted pod) reads them back instead of compiling again. An existing
``JAX_COMPILATION_CACHE_DIR`` (or ``jax_compilation_cache_dir`` already set in ``jax.config``) wins,
e.g. one directory on shared storage for every host of a pod: multi-process runs compile the same
SPMD programs on every process, so they hit the same entries. JAX's own cache is used as shipped
(its keys cover the program, the backend and the compiler flags); this module only picks the place.
"""
from __future__ import annotations

import os

import jax

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

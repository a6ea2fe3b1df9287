"""Test-suite set-up: 8 host CPU devices so multi-device sharding is exercised on any machine, and
one persistent XLA compilation cache for the whole session.

Many tests build the same tiny programs again in a new object or a new process (a resumed
trainer, a rerun after SIGKILL, the processes of a multi-host run); the cache makes every
compilation after the first a file read, which halves those tests. It starts empty in a fresh
directory (removed at exit), so no run depends on an earlier one; a caller's own
``JAX_COMPILATION_CACHE_DIR`` wins. Subprocesses inherit it through the environment.
"""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="pytest-xla-cache-")  # not "jaxes-": sandbox leak checks look for those
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  # Cache every program, however small or quick to compile: the tests' programs are tiny.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

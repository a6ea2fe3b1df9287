"""The trainer's persistent compilation cache: where it goes, and that a real compile lands there."""
import os
import subprocess
import sys
import textwrap

import pytest

from jaxes.train import compile_cache


def test_cache_dir_defaults_under_the_workdir_and_honours_the_environment(tmp_path):
  assert compile_cache.cache_dir(str(tmp_path), environ={}) == str(tmp_path / "compile-cache")
  shared = str(tmp_path / "shared")
  assert compile_cache.cache_dir(str(tmp_path), environ={"JAX_COMPILATION_CACHE_DIR": shared}) == shared


@pytest.mark.end_to_end
def test_enable_writes_compiled_programs_under_the_workdir(tmp_path):
  # A fresh process without the suite's cache directory, as a user's first run sees it.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  script = textwrap.dedent(f"""
    import jax, jax.numpy as jnp
    from jaxes.train import compile_cache
    print(compile_cache.enable({str(tmp_path)!r}))
    jax.jit(lambda x: jnp.sin(x) * 3.0)(jnp.ones(4)).block_until_ready()
  """)
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  cache = tmp_path / "compile-cache"
  assert out.stdout.strip() == str(cache)
  assert any(cache.iterdir()), "no compiled program was written to the cache"

"""The trainer's start-up compile: every program in parallel threads, a progress bar, errors raised."""
import io

import jax
import jax.numpy as jnp
import pytest

from jaxes.train import precompile


def _lowered(n: int) -> dict:
  x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  return {f"p{i}": jax.jit(lambda a, i=i: jnp.tanh(a @ a) * (i + 1)).lower(x) for i in range(n)}


def test_warm_up_compiles_every_program_in_threads_with_a_progress_bar():
  bar, lines = io.StringIO(), []
  run = precompile.warm_up(lambda: _lowered(3), jobs=2, log=lines.append, file=bar)
  assert [p.name for p in run.programs] == ["p0", "p1", "p2"]   # in the order given
  assert all(p.error is None and p.seconds > 0 for p in run.programs)
  assert "compiling 3 programs: 3/3" in bar.getvalue()
  assert lines == [lines[0]] and lines[0].startswith("compiled 3 programs in ") and "2 thread(s)" in lines[0]


def test_warm_up_off_and_bad_jobs():
  def never_lowered():
    raise AssertionError("jobs=0 lowers nothing")
  assert precompile.warm_up(never_lowered, jobs=0, log=print) is None   # each compiles when first called
  with pytest.raises(ValueError, match=r"config.train.compile_jobs: must be >= 0"):
    precompile.warm_up(lambda: _lowered(1), jobs=-1)


def test_a_program_that_fails_to_compile_raises_its_error():
  class Broken:
    def compile(self):
      raise RuntimeError("no such op")

  with pytest.raises(RuntimeError, match="no such op"):
    precompile.warm_up(lambda: {**_lowered(1), "broken": Broken()}, jobs=2, log=print, progress=False)
  run = precompile.compile_all({"broken": Broken()})
  assert isinstance(run.programs[0].error, RuntimeError) and run.programs[0].result is None

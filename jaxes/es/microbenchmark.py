"""EGGROLL's throughput microbenchmark through this package's noiser: one linear layer, a distinct
low-rank member per row, no update, against the plain matmul.

By its maintainers' account (HyperscaleES issue #4, as ../shared/ANCHORS.md records it): input
1024 x 8192, batch = population, a different member per row, no update, at 91% of pure
batch-inference throughput. Read here as 1024 rows (members) of 8192 features into a square
8192 x 8192 layer (the output width is not stated); on CPU a scaled-down layer. ``python -m
jaxes.measure`` reports it beside the end-to-end cost; ``benchmarks/eggroll.py`` runs it alone.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxes.es.strategy import Strategy

EGGROLL_SHAPE = (1024, 8192, 8192)     # (rows = members, in, out)
EGGROLL_CPU_SHAPE = (64, 512, 512)
EGGROLL_REPORTED = 0.91                # "91% of pure batch-inference throughput"


def eggroll_shape(platform: str) -> tuple[int, int, int]:
  """The layer for a platform ("cpu", "gpu", "tpu"): EGGROLL's, scaled down on CPU."""
  return EGGROLL_CPU_SHAPE if platform == "cpu" else EGGROLL_SHAPE


def eggroll(shape: tuple[int, int, int], dtype, repeats: int = 20) -> dict:
  """Plain ``x @ w`` vs the same layer through the noiser with a distinct low-rank (rank 1)
  member per row, no update: the noiser built once (as the engine reuses it over decode steps),
  the matmul timed (best of ``repeats`` after a warm-up call); throughput relative to the plain
  layer."""
  rows, n_in, n_out = shape
  key_w, key_x = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(key_w, (n_in, n_out), jnp.float32).astype(dtype)}
  x = jax.random.normal(key_x, (rows, n_in), jnp.float32).astype(dtype)
  strategy = Strategy(population=rows, sigma=1e-3, learning_rate=1e-3, mode="lowrank", rank=1)
  members = jnp.arange(rows, dtype=jnp.int32)
  noiser = jax.jit(lambda p: strategy.member_noiser(
      p, jnp.zeros(rows, jnp.int32), members, members, run_key=jax.random.key(1)))(params)
  plain = jax.jit(lambda x, w: x @ w)
  perturbed = jax.jit(lambda x, w, noiser: noiser.dense(x, w, None, name="w"))

  def best(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t)
    return min(times)

  plain_s = best(plain, x, params["w"])
  es_s = best(perturbed, x, params["w"], noiser)
  return {"shape": list(shape), "dtype": jnp.dtype(dtype).name, "plain_s": plain_s, "es_s": es_s,
          "es_over_plain": plain_s / es_s, "reported": EGGROLL_REPORTED}

"""The paged cache access (``jaxes.models.attention.pages``): the same keys laid out in pages,
split or interleaved, are written and attended to as the unpaged cache's rows."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxes.models import attention, kernels_tpu
from jaxes.models.attention import pages
from jaxes.models.attention.rows import Dense

L, B, S, K, G, hd, T, PAGE = 2, 2, 16, 2, 2, 8, 3, 4
TABLE = np.array([[3, 7, 1, 0], [5, 2, 6, 4]])   # each row's pages of an 8-page pool


def paged(cache):
  """``[L, B, S, K, hd]`` rows -> ``[L, 8, PAGE, K, hd]`` pages through ``TABLE``."""
  out = np.zeros((L, 8, PAGE, K, hd), np.float32)
  for b in range(B):
    for j, page in enumerate(TABLE[b]):
      out[:, page] = cache[:, b, j * PAGE:(j + 1) * PAGE]
  return jnp.asarray(out)


def test_pages_attend_and_write_as_the_rows_they_hold():
  r = np.random.default_rng(0)
  cache_k, cache_v = (r.normal(size=(L, B, S, K, hd)).astype(np.float32) for _ in range(2))
  q = jnp.asarray(r.normal(size=(B, T, K, G, hd)), jnp.float32)
  new_k, new_v = (jnp.asarray(r.normal(size=(B, T, K, hd)), jnp.float32) for _ in range(2))
  at = attention.Addressing(jnp.arange(S)[None, :] <= jnp.asarray([[9], [14]]),
                            jnp.asarray([[7, 8, 9], [12, 13, 14]], jnp.int32), S,
                            jnp.asarray([[7, 8, 9], [12, 13, S]], jnp.int32), block=2 * PAGE)
  layer = jnp.int32(1)
  rows = attention.layer_cache(jnp.asarray(cache_k), jnp.asarray(cache_v), Dense(), at)
  split = attention.layer_cache(paged(cache_k), paged(cache_v), pages.Pages(jnp.asarray(TABLE)), at)
  np.testing.assert_allclose(split.attend(q, layer), rows.attend(q, layer), rtol=1e-6, atol=1e-6)
  written = split.access.write(split, layer, new_k, new_v)
  want = rows.access.write(rows, layer, new_k, new_v)
  for got, expected in zip(written, want):
    np.testing.assert_array_equal(got, paged(np.asarray(expected)))
  combined = kernels_tpu.combined_pages(split.k, split.v)
  empty = jnp.zeros(combined.shape[:3] + (0, hd), combined.dtype)
  mixed = dataclasses.replace(split, k=combined, v=empty)
  assert split.access.cache_kind(empty) == "paged_interleaved"
  np.testing.assert_allclose(mixed.attend(q, layer), rows.attend(q, layer), rtol=1e-6, atol=1e-6)

"""The unpaged cache accesses (``jaxes.models.attention.rows``): ``Rows`` (some rows of a cache,
per device) writes and attends as ``Dense`` does over a cache of those rows alone, bit for bit,
and leaves the other rows untouched."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxes.models import attention
from jaxes.models.attention import rows
from jaxes.models.attention.keys import Addressing

L, B, S, K, G, hd, T = 2, 3, 16, 2, 2, 8, 3
INDEX = np.array([2, 0])   # batch row i is cache row INDEX[i]


def case(seed=0):
  r = np.random.default_rng(seed)
  cache_k, cache_v = (jnp.asarray(r.normal(size=(L, B, S, K, hd)), jnp.float32) for _ in range(2))
  q = jnp.asarray(r.normal(size=(2, T, K, G, hd)), jnp.float32)
  new_k, new_v = (jnp.asarray(r.normal(size=(2, T, K, hd)), jnp.float32) for _ in range(2))
  q_slots = jnp.asarray([[6, 7, 8], [1, 2, 3]], jnp.int32)
  valid = jnp.arange(S)[None, :] <= jnp.asarray([8, 3])[:, None]
  write_slots = jnp.asarray([[6, 7, S], [1, 2, 3]], jnp.int32)   # row 0's last token: padding
  return cache_k, cache_v, q, new_k, new_v, Addressing(valid, q_slots, S, write_slots, block=4)


def test_rows_attend_and_write_as_dense_over_those_rows():
  cache_k, cache_v, q, new_k, new_v, at = case()
  layer = jnp.int32(1)
  picked = attention.layer_cache(cache_k, cache_v, rows.Rows(jnp.asarray(INDEX)), at)
  alone = attention.layer_cache(cache_k[:, INDEX], cache_v[:, INDEX], rows.Dense(), at)
  np.testing.assert_array_equal(jax.jit(lambda c: c.attend(q, layer))(picked),
                                alone.attend(q, layer))
  written = picked.access.write(picked, layer, new_k, new_v)
  want = alone.access.write(alone, layer, new_k, new_v)
  for got, expected, before in zip(written, want, (cache_k, cache_v)):
    np.testing.assert_array_equal(got[:, INDEX], expected)
    np.testing.assert_array_equal(got[:, 1], before[:, 1])   # a row the batch does not name


def test_rows_on_a_mesh_run_per_device():
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  cache_k, cache_v, q, _, _, at = case(1)
  access = rows.Rows(jnp.asarray(INDEX), mesh, "data")
  assert access.platform == "cpu" and access.cache_kind(cache_v) == "dense" and access.names_rows
  out = attention.layer_cache(cache_k, cache_v, access, at).attend(q, jnp.int32(0))
  alone = attention.layer_cache(cache_k[:, INDEX], cache_v[:, INDEX], rows.Dense(), at)
  np.testing.assert_array_equal(out, alone.attend(q, jnp.int32(0)))
  np.testing.assert_array_equal(access.take(jnp.arange(B)), INDEX)
  np.testing.assert_array_equal(access.advance(jnp.zeros(B, jnp.int32), jnp.asarray([5, 7])),
                                [7, 0, 5])

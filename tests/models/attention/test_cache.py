"""A layer's view of the cache (``jaxes.models.attention.cache``): ``layer_cache`` asks the table
once for the access's platform and cache kind, and a bounded read's key block with it; the
``LayerCache`` is one pytree (its implementation static); ``write`` stores the new keys' bits."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxes.models import attention
from jaxes.models.attention import cache, dispatch
from jaxes.models.attention.keys import Addressing

S, K, hd = 8, 2, 4


def test_the_implementation_is_chosen_once_from_the_access():
  buffers = jnp.zeros((1, 2, S, K, hd), jnp.uint32)
  slots = jnp.zeros((2, 1), jnp.int32)
  at = Addressing(jnp.ones((2, S), bool), slots, S, slots, bounded=True)
  dense = cache.layer_cache(buffers, buffers, attention.Dense(), at, jnp.float32)
  assert dense.impl is dispatch.choose("cpu", "dense") and dense.addressing.block == 64
  empty = jnp.zeros((1, 2, S, 0, hd), jnp.float32)
  paged = cache.layer_cache(buffers, empty, attention.Pages(jnp.zeros((2, 2), jnp.int32)), at)
  assert paged.impl is dispatch.choose("cpu", "paged_interleaved")
  leaves, tree = jax.tree.flatten(dense)
  assert len(leaves) == 5   # k, v, valid, q_slots, write_slots: the implementation is static
  assert jax.tree.unflatten(tree, leaves).impl is dense.impl


def test_a_write_stores_the_new_keys_bits_at_their_slots():
  buffers = jnp.zeros((2, 1, S, K, hd), jnp.uint16)
  at = Addressing(None, None, S, jnp.asarray([[2, S]], jnp.int32))
  layer = cache.layer_cache(buffers, buffers, attention.Dense(), at, jnp.dtype(jnp.bfloat16))
  k = jnp.full((1, 2, K, hd), 1.5, jnp.float32)
  written = jax.jit(lambda c: c.write(jnp.int32(1), k, -k))(layer)
  keys = jax.lax.bitcast_convert_type(written.k, jnp.bfloat16)
  np.testing.assert_array_equal(keys[1, 0, 2], np.full((K, hd), 1.5))
  assert int(jnp.count_nonzero(written.k)) == K * hd   # the padding token (slot S) dropped
  assert written.k.dtype == jnp.uint16 and cache.as_bits(jnp.ones(2, jnp.bfloat16)).dtype == jnp.uint16
  np.testing.assert_array_equal(jax.lax.bitcast_convert_type(written.v, jnp.bfloat16)[1, 0, 2], -1.5)

"""The table's built-in implementations (``jaxes.models.attention.implementations``): blockwise
over a cache equals one softmax over its keys, and cuDNN, where it refuses the call (here, off a
GPU), is blockwise bit for bit."""
import jax.numpy as jnp
import numpy as np

from jaxes.models.attention import dispatch, implementations, softmax
from jaxes.models.attention.keys import Addressing, KeyView


def view(bounded):
  r = np.random.default_rng(0)
  k, v = (jnp.asarray(r.normal(size=(2, 16, 2, 8)), jnp.float32) for _ in range(2))
  valid = jnp.arange(16)[None, :] < jnp.asarray([[11], [5]])
  q_slots = jnp.asarray([[8, 9, 10], [2, 3, 0]], jnp.int32)
  read = lambda start, n: (k[:, start:start + n], v[:, start:start + n]) if isinstance(start, int) \
      else tuple(jnp.take(x, start + jnp.arange(n), axis=1) for x in (k, v))
  q = jnp.asarray(r.normal(size=(2, 3, 2, 2, 8)), jnp.float32)
  return q, k, v, KeyView(read, Addressing(valid, q_slots, span=16, bounded=bounded, block=4))


def test_blockwise_over_a_cache_is_one_softmax():
  for bounded in (False, True):
    q, k, v, keys = view(bounded)
    out = implementations.blockwise_cached(q, keys)
    np.testing.assert_allclose(out, softmax.dense(q, k, v, keys.visible(0, 16)), atol=2e-6, rtol=0)


def test_cudnn_refused_is_blockwise():
  q, _, _, keys = view(False)
  np.testing.assert_array_equal(implementations.cudnn_cached(q, keys),
                                implementations.blockwise_cached(q, keys))
  assert dispatch.choose("gpu", "dense") is implementations.CUDNN
  assert implementations.CUDNN.reads_whole_span and not implementations.BLOCKWISE.reads_whole_span

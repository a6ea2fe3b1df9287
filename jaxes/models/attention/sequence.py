"""Causal self-attention of a whole sequence, no cache (the uncached forward: training, scoring):
``causal``, and ``attend_sequence``, the forward's call, by the dispatch table's implementation
for cache kind ``"none"``."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxes.models.attention import dispatch, softmax
from jaxes.models.attention.keys import Addressing, KeyView


def causal(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
           block: int | None = None) -> jax.Array:
  """Causal self-attention of a whole sequence (the uncached forward): query t of row b sees
  key s iff ``s <= t`` and ``valid[b, s]``. ``q [B, T, K, G, hd]``, ``k, v [B, T, K, hd]``,
  ``valid`` bool [B, T].

  Up to ``block`` tokens (default ``softmax.KV_BLOCK``): ``dense``. Longer: the queries in blocks
  of ``block`` (T padded up to a multiple), each attending through ``blockwise`` to the keys up
  to its end, under ``jax.checkpoint``, so neither the forward nor its gradient ever holds more
  than one query block's float32 scores ``[B, K, G, block, T]``; the backward recomputes a
  block's scores instead of keeping the ``[B, K, G, T, T]`` a dense softmax would. Equals
  ``dense`` up to float rounding. (cuDNN's fused causal attention would be faster on GPU; not
  used here since its padding mask must be a prefix per row, which this function does not
  assume.)
  """
  B, T, K, G, hd = q.shape
  n = softmax.KV_BLOCK if block is None else block
  if T <= n:
    return softmax.dense(q, k, v, valid[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None])
  blocks = -(-T // n)
  pad = blocks * n - T
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in (q, k, v))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))

  def read(start, m):
    return (jax.lax.dynamic_slice_in_dim(k, start, m, axis=1),
            jax.lax.dynamic_slice_in_dim(v, start, m, axis=1))

  @jax.checkpoint
  def query_block(i):
    queries = i * n + jnp.arange(n)

    def visible(start, m):
      keys = start + jnp.arange(m)
      return (jax.lax.dynamic_slice_in_dim(valid, start, m, axis=1)[:, None, :]
              & (keys[None, :] <= queries[:, None])[None])

    # Every query block scans all key blocks (the scan's length is static); those past its end
    # are fully masked and add nothing but their flops.
    return softmax.blockwise(jax.lax.dynamic_slice_in_dim(q, i * n, n, axis=1), read, visible,
                             blocks * n, n)

  out = jax.lax.map(query_block, jnp.arange(blocks))   # [blocks, B, n, K, G, hd]
  return jnp.moveaxis(out, 0, 1).reshape(B, blocks * n, K, G, hd)[:, :T]


def causal_sequence(q: jax.Array, keys: KeyView) -> jax.Array:
  """``causal`` over a whole sequence's own keys (the table's implementation for no cache)."""
  k, v = keys.read(0, keys.span)
  return causal(q, k, v, keys.addressing.valid, keys.addressing.block)


def attend_sequence(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                    platform: str | None = None) -> jax.Array:
  """Causal self-attention of a whole sequence (no cache) by the dispatch table's implementation:
  ``q [B, T, K, G, hd]``, ``k, v [B, T, K, hd]``, ``valid`` bool [B, T] (see ``causal``)."""
  def read(start, n):
    if isinstance(start, int) and start == 0 and n == k.shape[1]:
      return k, v   # the whole sequence, as is (no slice in the program)
    return (jax.lax.dynamic_slice_in_dim(k, start, n, axis=1),
            jax.lax.dynamic_slice_in_dim(v, start, n, axis=1))
  impl = dispatch.choose(dispatch.target_platform() if platform is None else platform, "none")
  return impl.fn(q, KeyView(read, Addressing(valid, None, span=k.shape[1])))

"""Grouped-query attention kernels that never hold a ``[.., queries, keys]`` float32 score tensor
for the whole key range.

Layouts: queries ``q [B, T, K, G, hd]`` (K KV heads, G query heads per KV head; KV heads are never
repeated), keys/values ``[B, S, K, hd]``, outputs ``[B, T, K, G, hd]`` in ``q``'s dtype.

* ``dense``: one softmax over all keys — the reference, used when the keys are few (the uncached
  forward of a short sequence) and by the tests.
* ``blockwise``: the keys in blocks of ``block``, with an online softmax (running max, sum and
  weighted values in float32): temporaries are ``[B, K, G, T, block]`` whatever the key range.
  Plain JAX, so it runs on every backend; the engine's cached decode uses it on CPU and TPU.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (flash attention) on GPU
  when cuDNN takes the call (bf16/fp16), else ``blockwise``.

Why not the Pallas TPU kernels: ``pallas.ops.tpu.flash_attention`` aligns its causal mask at key 0,
while a cache row here is a prefix of slots whose queries sit at a per-row offset; and
``ragged_paged_attention`` needs a paged cache layout (pages + page tables) that the engine does
not use. ``blockwise`` bounds the memory the same way; it does not fuse as well.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# A finite floor (not -inf) keeps rows without any visible key (padding) free of NaN.
_FLOOR = float(jnp.finfo(jnp.float32).min)
KV_BLOCK = 512  # keys per block (read at trace time, so tests can shrink it)


def dense(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """mask: bool [B, T, S], which keys each query sees."""
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
  scores = jnp.where(mask[:, None, None], scores, _FLOOR)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(q.dtype))


def block_size(span: int, block: int) -> int:
  """The largest divisor of ``span`` that is at most ``block`` (blocks tile the span exactly)."""
  return max(d for d in range(1, min(span, block) + 1) if span % d == 0)


def blockwise(q: jax.Array, read: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]],
              visible: Callable[[jax.Array, int], jax.Array], span: int,
              block: int | None = None) -> jax.Array:
  """Online-softmax attention over keys ``[0, span)`` read ``block`` at a time.

  ``read(start, n) -> (k, v)`` each ``[B, n, K, hd]`` and ``visible(start, n) -> bool [B, T, n]``
  give one block (``start`` is traced); reading through callbacks lets the caller slice a block
  straight out of a larger buffer (the engine's whole cache) instead of copying the span first.
  Equals ``dense`` over the same keys up to float rounding.
  """
  n = block_size(span, KV_BLOCK if block is None else block)
  B, T, K, G, hd = q.shape
  scale = hd ** -0.5

  def one_block(carry, j):
    m, l, acc = carry
    start = j * n
    k, v = read(start, n)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k.astype(q.dtype),
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible(start, n)[:, None, None], s, _FLOOR)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgts,bskh->bkgth", p.astype(q.dtype), v.astype(q.dtype),
        preferred_element_type=jnp.float32)
    return (m_new, l, acc), None

  init = (jnp.full((B, K, G, T), _FLOOR, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
          jnp.zeros((B, K, G, T, hd), jnp.float32))
  (_, l, acc), _ = jax.lax.scan(one_block, init, jnp.arange(span // n))
  out = acc / l[..., None]
  return jnp.moveaxis(out, 3, 1).astype(q.dtype)  # [B, K, G, T, hd] -> [B, T, K, G, hd]


def _cudnn(q, k, v, mask):
  """cuDNN flash attention on the GPU, or None when cuDNN refuses the call (dtype, shape)."""
  B, T, K, G, hd = q.shape
  try:
    out = jax.nn.dot_product_attention(q.reshape(B, T, K * G, hd), k.astype(q.dtype),
                                       v.astype(q.dtype), mask=mask[:, None],
                                       implementation="cudnn")
  except (ValueError, NotImplementedError, RuntimeError):
    return None
  return out.reshape(B, T, K, G, hd)


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s raw bits as unsigned ints of its width (a free bitcast)."""
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def cached(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
           cache_valid: jax.Array, q_slots: jax.Array, span: int, dtype=None,
           block: int | None = None) -> jax.Array:
  """Attention of ``q`` to the first ``span`` slots of layer ``layer`` of a ``[L, B, S, K, hd]``
  cache; query t of row b sees slot s iff ``cache_valid[b, s]`` and ``s <= q_slots[b, t]``.
  ``dtype``: the cache holds raw bits (``as_bits``) of this dtype; None: plain values. Blocks
  are read as bits and converted one at a time, so no compiler can hoist a dtype conversion of
  the whole cache out of the block loop (the CPU backend, which computes bfloat16 dots in
  float32, did: a float32 copy of the cache)."""
  B = q.shape[0]
  K, hd = cache_k.shape[-2:]

  def read(start, n):
    at = (layer, 0, start, 0, 0)
    size = (1, B, n, K, hd)
    k, v = (jax.lax.dynamic_slice(c, at, size)[0] for c in (cache_k, cache_v))
    if dtype is not None:
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v

  def visible(start, n):
    keys = start + jnp.arange(n)
    return (jax.lax.dynamic_slice_in_dim(cache_valid, start, n, axis=1)[:, None, :]
            & (keys[None, None, :] <= q_slots[:, :, None]))

  if jax.default_backend() == "gpu":
    k, v = read(0, span)
    out = _cudnn(q, k, v, visible(0, span))
    if out is not None:
      return out
  return blockwise(q, read, visible, span, block)

"""The attention math every implementation shares, over keys it is handed or reads through
callbacks: ``dense`` (one softmax, the reference), ``blockwise`` (an online softmax over key
blocks, which never holds a ``[.., queries, keys]`` float32 score tensor for the whole key range)
and ``cudnn`` (cuDNN's flash attention, where it takes the call).

Layouts: queries ``q [B, T, K, G, hd]`` (K KV heads, G query heads per KV head; KV heads are never
repeated), keys/values ``[B, S, K, hd]``, outputs ``[B, T, K, G, hd]`` in ``q``'s dtype.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# A finite floor (not -inf) keeps rows without any visible key (padding) free of NaN.
FLOOR = float(jnp.finfo(jnp.float32).min)
KV_BLOCK = 512  # keys per block (read at trace time, so tests can shrink it)


def dense(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """mask: bool [B, T, S], which keys each query sees."""
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k.astype(q.dtype),
                      preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
  scores = jnp.where(mask[:, None, None], scores, FLOOR)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(q.dtype))


def block_size(span: int, block: int) -> int:
  """The largest divisor of ``span`` that is at most ``block`` (blocks tile the span exactly)."""
  return max(d for d in range(1, min(span, block) + 1) if span % d == 0)


def blockwise(q: jax.Array, read: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]],
              visible: Callable[[jax.Array, int], jax.Array], span: int,
              block: int | None = None, keys_needed: jax.Array | None = None) -> jax.Array:
  """Online-softmax attention over keys ``[0, span)`` read ``block`` at a time.

  ``read(start, n) -> (k, v)`` each ``[B, n, K, hd]`` and ``visible(start, n) -> bool [B, T, n]``
  give one block (``start`` is traced); reading through callbacks lets the caller slice a block
  straight out of a larger buffer (the engine's whole cache) instead of copying the span first.
  ``keys_needed`` (traced int, or None: the whole span): no query sees a key at or past it, so
  the blocks after it are not read (a loop with a traced trip count: one program serves every
  attention length). Equals ``dense`` over the same keys up to float rounding (a skipped block
  is fully masked: it would add exactly nothing).
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
    s = jnp.where(visible(start, n)[:, None, None], s, FLOOR)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgts,bskh->bkgth", p.astype(q.dtype), v.astype(q.dtype),
        preferred_element_type=jnp.float32)
    return (m_new, l, acc), None

  init = (jnp.full((B, K, G, T), FLOOR, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
          jnp.zeros((B, K, G, T, hd), jnp.float32))
  if keys_needed is None:
    (_, l, acc), _ = jax.lax.scan(one_block, init, jnp.arange(span // n))
  else:
    blocks = jnp.clip((keys_needed + n - 1) // n, 1, span // n)
    _, l, acc = jax.lax.fori_loop(0, blocks, lambda j, carry: one_block(carry, j)[0], init)
  out = acc / l[..., None]
  return jnp.moveaxis(out, 3, 1).astype(q.dtype)  # [B, K, G, T, hd] -> [B, T, K, G, hd]


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array | None:
  """cuDNN flash attention on the GPU, or None when cuDNN refuses the call (dtype, shape)."""
  B, T, K, G, hd = q.shape
  try:
    out = jax.nn.dot_product_attention(q.reshape(B, T, K * G, hd), k.astype(q.dtype),
                                       v.astype(q.dtype), mask=mask[:, None],
                                       implementation="cudnn")
  except (ValueError, NotImplementedError, RuntimeError):
    return None
  return out.reshape(B, T, K, G, hd)

"""Paged attention on TPU through the kernel JAX ships: ``jax.experimental.pallas.ops.tpu.
ragged_paged_attention`` (mixed prefill and decode tokens as one flat batch).

What the kernel takes, and how an engine call's batch becomes it (per device, under the caller's
``shard_map``; every array here is one shard's):

* ``queries [tokens, heads, hd]``: the batch's real tokens packed row after row (``cu_q_lens``
  says where each row's start). A batch row's real tokens are its leading positions (the engine
  left-aligns a prefill chunk; a decode row has one), at consecutive slots from its cache index;
  padding after them is left out, and its outputs are zero.
* ``kv_lens [rows]``: the slots a row's last token sees, ``index + real tokens``. The kernel sees
  every slot below it, so a paged row's valid slots must be a prefix (the engine writes a row in
  order from slot 0 and only a reset clears it). A row with no real token is given one query at
  slot 0 (the kernel needs ``q_len <= kv_len``); its output is dropped.
* ``kv_pages [pages, page, 2 * K, hd]``, keys and values interleaved over the head axis, in the
  compute dtype: the cache's interleaved pages ``[L, P, page, 2K, hd]`` (``attention.
  interleaved``) seen as ``L * P`` pages, a free reshape (a layer's slice would be a copy of its
  pool). They hold values, not raw bits: the TPU compiler makes a whole-cache bitcast a copy
  (1.1 GB of temporaries per device at the benchmark's v5p-64 shapes). ``combined_pages`` turns
  pages kept apart (``[L, P, page, K, hd]`` keys and values) into this layout; run at every call
  it would copy the pool every layer (``benchmarks/attention_kernels.py`` measures it).
* ``page_indices``: the rows' page tables (shard-local page ids) plus ``layer * P``.

The block sizes are passed explicitly (``kv_pages_per_block``): the kernel's tuned-size lookup
reads the local device, which is a CPU in a deviceless compile for a TPU topology.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as _rpa

# Keys per kernel block (its untuned default, 128 pages, is 2,048 keys at 16-key pages; fixed in
# pages, 128-key pages ran out of VMEM at 32 MiB on v5p), queries per block (its default), and a
# scoped VMEM limit every TPU from v4 on has room for.
KV_TOKENS_PER_BLOCK = 2048
QUERIES_PER_BLOCK = 32
VMEM_LIMIT_BYTES = 32 * 2**20


def kv_pages_per_block(page: int, pages_per_row: int) -> int:
  """The kernel's ``num_kv_pages_per_block``: ``KV_TOKENS_PER_BLOCK`` keys, at most a row."""
  return max(1, min(KV_TOKENS_PER_BLOCK // page, pages_per_row))

ragged_paged_attention = _rpa.ragged_paged_attention
reference = _rpa.ref_ragged_paged_attention   # JAX's plain-JAX reference of the same layout


def ragged_lengths(q_slots: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(q_lens, kv_lens, cu_q_lens)`` int32 of a batch whose row i's real tokens are its leading
  positions at consecutive slots ``q_slots[i, 0] + t`` (``q_slots [n, T]``; padding after them
  points elsewhere). A row without real tokens (all padding) counts one query at slot
  ``max(q_slots[i, 0], 0)``."""
  T = q_slots.shape[1]
  start = jnp.maximum(q_slots[:, :1], 0)
  in_run = q_slots == start + jnp.arange(T, dtype=q_slots.dtype)[None, :]
  q_lens = jnp.maximum(jnp.cumprod(in_run, axis=1).sum(axis=1), 1).astype(jnp.int32)
  kv_lens = (start[:, 0] + q_lens).astype(jnp.int32)
  cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
  return q_lens, kv_lens, cu_q_lens


def pack(x: jax.Array, q_lens: jax.Array, cu_q_lens: jax.Array) -> jax.Array:
  """``x [n, T, ...]`` -> ``[n * T, ...]``: row i's first ``q_lens[i]`` positions at
  ``cu_q_lens[i] ...``, zeros after the last row's."""
  n, T = x.shape[:2]
  t = jnp.arange(T)[None, :]
  to = jnp.where(t < q_lens[:, None], cu_q_lens[:-1, None] + t, n * T)   # n * T: dropped
  return jnp.zeros((n * T,) + x.shape[2:], x.dtype).at[to].set(x, mode="drop")


def unpack(flat: jax.Array, q_lens: jax.Array, cu_q_lens: jax.Array, T: int) -> jax.Array:
  """``pack``'s inverse: ``[n * T, ...]`` -> ``[n, T, ...]``, zeros at the positions left out."""
  t = jnp.arange(T)[None, :]
  keep = t < q_lens[:, None]
  out = flat[jnp.where(keep, cu_q_lens[:-1, None] + t, 0)]
  return jnp.where(keep.reshape(keep.shape + (1,) * (out.ndim - 2)), out, 0)


def combined_pages(pages_k: jax.Array, pages_v: jax.Array) -> jax.Array:
  """Keys and values ``[L, P, page, K, hd]`` -> the interleaved ``[L, P, page, 2K, hd]``: head 2k
  the keys of KV head k, 2k + 1 its values."""
  L, P, page, K, hd = pages_k.shape
  return jnp.stack([pages_k, pages_v], axis=4).reshape(L, P, page, 2 * K, hd)


def kernel_inputs(q: jax.Array, pages: jax.Array, layer: jax.Array, q_slots: jax.Array,
                  table: jax.Array, dtype=None) -> tuple[jax.Array, ...]:
  """The kernel's positional arguments ``(queries, kv_pages, kv_lens, page_indices, cu_q_lens,
  num_seqs)`` for ``paged_attention``'s batch (see there)."""
  n, T, K, G, hd = q.shape
  q_lens, kv_lens, cu_q_lens = ragged_lengths(q_slots)
  flat = pack(q.reshape(n, T, K * G, hd), q_lens, cu_q_lens)   # q head k * G + g reads KV head k
  if dtype is not None and pages.dtype != dtype:   # raw bits: a copy of the whole cache on TPU
    pages = jax.lax.bitcast_convert_type(pages, dtype)
  L, P = pages.shape[:2]
  kv_pages = pages.reshape(L * P, *pages.shape[2:]).astype(q.dtype)
  # A table entry past a row's valid slots may name any page; kept in range for the DMA.
  page_indices = (jnp.clip(table, 0, P - 1) + layer * P).astype(jnp.int32)
  return flat, kv_pages, kv_lens, page_indices, cu_q_lens, jnp.full((1,), n, jnp.int32)


def kernel_outputs(out: jax.Array, q_slots: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The kernel's ``[tokens, heads, hd]`` output (its first ``cu_q_lens[-1]`` rows at least) back
  to the batch's ``[n, T, K, G, hd]``, zeros at the padding."""
  q_lens, _, cu_q_lens = ragged_lengths(q_slots)
  out = jnp.zeros((shape[0] * shape[1],) + out.shape[1:], out.dtype).at[:out.shape[0]].set(out)
  return unpack(out, q_lens, cu_q_lens, shape[1]).reshape(shape)


def paged_attention(q: jax.Array, pages: jax.Array, layer: jax.Array, q_slots: jax.Array,
                    table: jax.Array, dtype=None) -> jax.Array:
  """Attention of ``q [n, T, K, G, hd]`` (query t of row i at slot ``q_slots[i, t]``) to the
  pages ``table [n, S // page]`` of layer ``layer`` of interleaved ``pages [L, P, page, 2K, hd]``
  (values, or raw bits of ``dtype``) through ``ragged_paged_attention``, on one device."""
  args = kernel_inputs(q, pages, layer, q_slots, table, dtype)
  n, T = q.shape[:2]
  out = ragged_paged_attention(
      *args, sm_scale=q.shape[-1] ** -0.5,
      num_kv_pages_per_block=kv_pages_per_block(pages.shape[2], table.shape[1]),
      num_queries_per_block=min(QUERIES_PER_BLOCK, n * T), vmem_limit_bytes=VMEM_LIMIT_BYTES)
  return kernel_outputs(out, q_slots, q.shape)

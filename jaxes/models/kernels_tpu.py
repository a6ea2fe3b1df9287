"""Paged attention on TPU through the kernel JAX ships: ``jax.experimental.pallas.ops.tpu.
ragged_paged_attention`` (mixed prefill and decode tokens as one flat batch).

What the kernel takes, and how an engine call's batch becomes it (per device, under the caller's
``shard_map``; every array here is one shard's):

* ``queries [tokens, heads, hd]``: the batch's tokens in order, row after row, position after
  position (``[n, T]`` flattened, padding included: a free reshape). The kernel's *sequences*
  are runs of these tokens (``ragged_runs``): a token continues its predecessor's run when it
  reads the same pages (an equal page table) at the next slot. The engine's flat buffer (one
  token per batch row, ``step_program``) holds each row's chunk as consecutive tokens, so a
  512-token prefill chunk is one sequence whose keys the kernel reads once per block of
  ``QUERIES_PER_BLOCK`` queries, not once per token. Any batch gives the right attention this
  way: a run's query j sees the slots up to its own, as each token alone would.
* ``kv_lens [seqs]``: the slots a run's last token sees (its slot + 1). The kernel sees every
  slot below it, so a paged row's valid slots must be a prefix (the engine writes a row in order
  from slot 0 and only a reset clears it). Padding tokens query slot 0 (or repeat a slot), so
  they form runs of their own; their outputs are the caller's to drop.
* ``kv_pages [pages, page, 2 * K, hd]``, keys and values interleaved over the head axis, in the
  compute dtype: the cache's interleaved pages ``[L, P, page, 2K, hd]`` (``attention.
  interleaved``) seen as ``L * P`` pages, a free reshape (a layer's slice would be a copy of its
  pool). They hold values, not raw bits: the TPU compiler makes a whole-cache bitcast a copy
  (1.1 GB of temporaries per device at the benchmark's v5p-64 shapes). ``combined_pages`` turns
  pages kept apart (``[L, P, page, K, hd]`` keys and values) into this layout; run at every call
  it would copy the pool every layer (``benchmarks/attention_kernels.py`` measures it).
* ``page_indices [seqs, S // page]``: each run's page table (shard-local page ids) plus
  ``layer * P``. The kernel prefetches it into SMEM, 1 MiB on v5p: tokens x pages per row x 4
  bytes must fit (542 tokens of 16,384-slot rows: pages of 64 tokens or more; of 16, the
  compiler refuses 2.2 MB).

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


def ragged_runs(q_slots: jax.Array, table: jax.Array) -> tuple[jax.Array, ...]:
  """The kernel's sequences of a batch's ``n * T`` tokens in order (``q_slots [n, T]`` each
  token's slot, ``table [n, W]`` each batch row's pages): ``(kv_lens [N], seq_rows [N],
  cu_q_lens [N + 1], num_seqs [1])`` int32, N = n * T, where ``seq_rows`` is each run's batch
  row (its page table). A token starts a run unless it is at the slot after its predecessor's,
  in the same batch row or one with an equal page table. Runs past ``num_seqs`` are empty."""
  n, T = q_slots.shape
  N = n * T
  slots = jnp.maximum(q_slots, 0).reshape(N)
  token = jnp.arange(N)
  row = token // T
  same_pages = jnp.concatenate([jnp.zeros((1,), bool), jnp.all(table[1:] == table[:-1], axis=1)])
  follows = (token > 0) & (slots == jnp.roll(slots, 1) + 1) & ((token % T > 0) | same_pages[row])
  first = jnp.nonzero(~follows, size=N, fill_value=N)[0].astype(jnp.int32)   # each run's first token
  cu_q_lens = jnp.concatenate([first, jnp.full((1,), N, jnp.int32)])
  num_seqs = jnp.sum(~follows, dtype=jnp.int32)
  last = jnp.clip(cu_q_lens[1:] - 1, 0, N - 1)
  kv_lens = jnp.where(token < num_seqs, slots[last] + 1, 0).astype(jnp.int32)
  seq_rows = row[jnp.minimum(first, N - 1)].astype(jnp.int32)
  return kv_lens, seq_rows, cu_q_lens, num_seqs[None]


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
  kv_lens, seq_rows, cu_q_lens, num_seqs = ragged_runs(q_slots, table)
  queries = q.reshape(n * T, K * G, hd)   # q head k * G + g reads KV head k
  if dtype is not None and pages.dtype != dtype:   # raw bits: a copy of the whole cache on TPU
    pages = jax.lax.bitcast_convert_type(pages, dtype)
  L, P = pages.shape[:2]
  kv_pages = pages.reshape(L * P, *pages.shape[2:]).astype(q.dtype)
  # A table entry past a row's valid slots may name any page; kept in range for the DMA.
  page_indices = (jnp.clip(table[seq_rows], 0, P - 1) + layer * P).astype(jnp.int32)
  return queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs


def paged_attention(q: jax.Array, pages: jax.Array, layer: jax.Array, q_slots: jax.Array,
                    table: jax.Array, dtype=None) -> jax.Array:
  """Attention of ``q [n, T, K, G, hd]`` (query t of row i at slot ``q_slots[i, t]``) to the
  pages ``table [n, S // page]`` of layer ``layer`` of interleaved ``pages [L, P, page, 2K, hd]``
  (values, or raw bits of ``dtype``) through ``ragged_paged_attention``, on one device."""
  args = kernel_inputs(q, pages, layer, q_slots, table, dtype)
  out = ragged_paged_attention(
      *args, sm_scale=q.shape[-1] ** -0.5,
      num_kv_pages_per_block=kv_pages_per_block(pages.shape[2], table.shape[1]),
      num_queries_per_block=min(QUERIES_PER_BLOCK, q.shape[0] * q.shape[1]),
      vmem_limit_bytes=VMEM_LIMIT_BYTES)
  return out.reshape(q.shape)

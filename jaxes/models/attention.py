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

* ``Pages``: a paged cache (``qwen2.PagedKVCache``), per data shard: on TPU, with the pages in
  the kernel's interleaved layout, the Pallas kernel ``ragged_paged_attention``
  (``kernels_tpu``); otherwise ``blockwise`` over key blocks of whole pages gathered through each
  row's page table.

The path is chosen for the platform the program is compiled for (``target_platform``: the
mesh's devices), not the process's default backend, so a deviceless compile for a GPU or TPU
target from a CPU machine (the preflight) builds the program the real run would.

Why not the other Pallas TPU kernels: ``pallas.ops.tpu.flash_attention`` aligns its causal mask
at key 0, while a cache row here is a prefix of slots whose queries sit at a per-row offset.
``pallas.ops.tpu.paged_attention`` takes one query per row (decode only), while an engine call
mixes decode rows with prefill chunks; the unpaged cache (``Rows``, the ragged batch) stays on
``blockwise``, which bounds the memory the same way on every backend but does not fuse as well.

Why a paged cache on GPU is read by ``blockwise``, not ``pallas.ops.gpu.paged_attention`` /
``decode_attention``: those take one query per row (decode only) over heads-major pages of one
layer (``[KVH, pages, page, hd]``), so the engine's ``[L, P, page, K, hd]`` pages would be
relaid out every layer (on TPU the same relayout cost 9.9x the live keys and values against
blockwise's 1.9x, benchmarks/RESULTS.md); and a deviceless H100 compile cannot show a gain: at
a paper-config device's decode shapes (120 rows, 7 query heads over 1 KV head, 16,384 slots)
``decode_attention.gqa`` compiles but the compiled program has no ``cost_analysis()``, and
``paged_attention`` at its default blocks (128-token pages) asks 561 KB of the 232 KB of shared
memory. The GPU configs (``configs/paper.py``'s H100/H200
targets) run unpaged, where attention is cuDNN's.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxes.models import kernels_tpu

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
  if keys_needed is None:
    (_, l, acc), _ = jax.lax.scan(one_block, init, jnp.arange(span // n))
  else:
    blocks = jnp.clip((keys_needed + n - 1) // n, 1, span // n)
    _, l, acc = jax.lax.fori_loop(0, blocks, lambda j, carry: one_block(carry, j)[0], init)
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


def target_platform(mesh=None) -> str:
  """The platform a program runs on: that of ``mesh``'s devices, else of the mesh set by
  ``jax.set_mesh`` (abstract devices included), else the default backend. A deviceless compile
  for a TPU or GPU topology from a CPU process names its target here, not ``"cpu"``."""
  if mesh is not None:
    return mesh.devices.flat[0].platform
  device = jax.sharding.get_abstract_mesh().abstract_device
  return jax.default_backend() if device is None else device.platform


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s raw bits as unsigned ints of its width (a free bitcast)."""
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def cached(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
           cache_valid: jax.Array, q_slots: jax.Array, span: int, dtype=None,
           block: int | None = None, rows: "Rows | None" = None, bounded: bool = False,
           platform: str | None = None) -> jax.Array:
  """Attention of ``q`` to the first ``span`` slots of layer ``layer`` of a ``[L, B, S, K, hd]``
  cache; query t of row b sees slot s iff ``cache_valid[b, s]`` and ``s <= q_slots[b, t]``.
  ``dtype``: the cache holds raw bits (``as_bits``) of this dtype; None: plain values. Blocks
  are read as bits and converted one at a time, so no compiler can hoist a dtype conversion of
  the whole cache out of the block loop (the CPU backend, which computes bfloat16 dots in
  float32, did: a float32 copy of the cache). ``rows``: q's batch is those rows of the cache
  (``cache_valid`` and ``q_slots`` per batch row); see ``Rows``. ``bounded``: read key blocks
  up to the furthest query only (``_attend``). ``platform``: the target's (None:
  ``target_platform()``; ``rows`` name their own mesh's)."""
  if rows is not None:
    return rows.attend(q, cache_k, cache_v, layer, cache_valid, q_slots, span, dtype, block,
                       bounded)
  B = q.shape[0]
  K, hd = cache_k.shape[-2:]

  def read(start, n):
    at = (layer, 0, start, 0, 0)
    size = (1, B, n, K, hd)
    k, v = (jax.lax.dynamic_slice(c, at, size)[0] for c in (cache_k, cache_v))
    if dtype is not None:
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v

  return _attend(q, read, cache_valid, q_slots, span, block, bounded,
                 target_platform() if platform is None else platform)


def _attend_rows(q, cache_k, cache_v, layer, row_valid, q_slots, index, span, dtype, block,
                 bounded, platform):
  """``cached`` for batch row i reading cache row ``index[i]``, all on one device: each key block
  is gathered for the batch's rows only (``[n, block, K, hd]``), never their whole rows."""
  def read(start, n):
    keys = (start + jnp.arange(n))[None, :]
    k, v = (c[layer, index[:, None], keys] for c in (cache_k, cache_v))
    if dtype is not None:
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v

  return _attend(q, read, row_valid, q_slots, span, block, bounded, platform)


def _attend(q, read, valid, q_slots, span, block, bounded, platform):
  """Attention of ``q`` to the keys ``read(start, n)`` returns: query t of row b sees slot s iff
  ``valid[b, s]`` and ``s <= q_slots[b, t]``. cuDNN when ``platform`` is the GPU (handed the
  whole span; where cuDNN refuses the call, or is not installed, ``blockwise``), else
  ``blockwise``; ``bounded``: ``blockwise`` reads key blocks up to this device's furthest query
  only (``q_slots`` of padding tokens must not point past the real ones)."""
  def visible(start, n):
    keys = start + jnp.arange(n)
    return (jax.lax.dynamic_slice_in_dim(valid, start, n, axis=1)[:, None, :]
            & (keys[None, None, :] <= q_slots[:, :, None]))

  if platform == "gpu":
    k, v = read(0, span)
    out = _cudnn(q, k, v, visible(0, span))
    if out is not None:
      return out
  return blockwise(q, read, visible, span, block,
                   keys_needed=q_slots.max() + 1 if bounded else None)


def _per_device(mesh, fn, in_specs, out_specs):
  """``fn`` run on each device's shards under ``shard_map`` (``mesh`` None: ``fn`` itself)."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _kv_spec(batch_axis, heads_axis) -> P:
  """``[L, rows or pages, tokens, K, hd]`` keys or values: rows over ``batch_axis``, KV heads
  over ``heads_axis``."""
  return P(None, batch_axis, None, heads_axis, None)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["index"],
                   meta_fields=["mesh", "batch_axis", "heads_axis"])
@dataclasses.dataclass(frozen=True)
class Rows:
  """A batch made of some rows of per-slot arrays ``[B, ...]`` (the KV cache's batch axis, a
  noiser's per-row leaves) that are sharded over the mesh axis ``batch_axis`` in D equal shards.
  The batch has n = D * b rows laid out the same way, b per shard, and ``index [n]`` says which
  row of *its own shard's* B / D rows each batch row is. Every access runs per device under
  ``shard_map``: a device reads and writes its own rows in place and nothing else. (A gather or
  scatter with global row indices into a sharded axis leaves the partitioner to find that the
  indices are local; it may not, and then copies the cache.) ``mesh`` None: one device.
  ``heads_axis``: the mesh axis of the cache's KV heads (None: whole on every device)."""
  index: jax.Array
  mesh: Any = None
  batch_axis: Any = None
  heads_axis: Any = None

  def _local(self, fn, in_specs, out_specs):
    return _per_device(self.mesh, fn, in_specs, out_specs)

  def _cache_spec(self) -> P:
    return _kv_spec(self.batch_axis, self.heads_axis)

  def take(self, x: jax.Array) -> jax.Array:
    """``x [B, ...]`` (rows over ``batch_axis``, the rest whole) -> ``[n, ...]``."""
    rows = P(self.batch_axis)
    return self._local(lambda x, i: x[i], (rows, rows), rows)(x, self.index)

  def write(self, cache: jax.Array, layer: jax.Array, slots: jax.Array, x: jax.Array) -> jax.Array:
    """``cache [L, B, S, K, hd]`` with ``x [n, T, K, hd]`` written at layer ``layer``, row
    ``index[i]``, slots ``slots [n, T]`` (slots >= S dropped): only the new tokens move."""
    b, h = self.batch_axis, self.heads_axis
    def fn(cache, layer, slots, x, i):
      return cache.at[layer, i[:, None], slots].set(x, mode="drop")
    return self._local(fn, (self._cache_spec(), P(), P(b), P(b, None, h), P(b)),
                       self._cache_spec())(cache, layer, slots, x, self.index)

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    """``valid [B, S]`` with ``slots [n, T]`` of each batch row's cache row set (>= S dropped)."""
    rows = P(self.batch_axis)
    def fn(valid, slots, i):
      return valid.at[i[:, None], slots].set(True, mode="drop")
    return self._local(fn, (rows, rows, rows), rows)(valid, slots, self.index)

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    """``index [B]`` plus ``counts [n]`` at each batch row's cache row (padding rows add 0)."""
    rows = P(self.batch_axis)
    return self._local(lambda x, c, i: x.at[i].add(c), (rows, rows, rows), rows)(
        index, counts, self.index)

  def attend(self, q, cache_k, cache_v, layer, row_valid, q_slots, span, dtype=None, block=None,
             bounded=False, platform=None):
    """``cached`` for these rows: ``q [n, T, K, G, hd]``, ``row_valid [n, S]``, ``q_slots [n, T]``
    (``bounded``: see ``_attend``; ``platform`` None: the mesh's, ``target_platform``)."""
    b, h = self.batch_axis, self.heads_axis
    fn = functools.partial(_attend_rows, span=span, dtype=dtype, block=block, bounded=bounded,
                           platform=platform or target_platform(self.mesh))
    cache = self._cache_spec()
    return self._local(fn, (P(b, None, h), cache, cache, P(), P(b), P(b), P(b)),
                       P(b, None, h))(q, cache_k, cache_v, layer, row_valid, q_slots, self.index)


def _page_block(span: int, page: int, block: int | None) -> int:
  """Keys per block of a paged read: whole pages, as many as fit in ``block`` and tile ``span``."""
  if span % page:
    raise ValueError(f"attention span {span} is not a multiple of the page size {page}")
  return page * block_size(span // page, max(1, (KV_BLOCK if block is None else block) // page))


def interleaved(pages_v: jax.Array) -> bool:
  """Whether a paged cache is in ``ragged_paged_attention``'s layout: keys and values interleaved
  over the head axis of one ``[L, P, page, 2K, hd]`` array (``pages_k``: head 2k the keys of KV
  head k, 2k + 1 its values), ``pages_v`` an empty ``[L, P, page, 0, hd]`` placeholder. Such
  pages may hold values rather than raw bits (``qwen2.PagedKVCache.init(interleaved=True)``)."""
  return pages_v.shape[-2] == 0


def interleave_pages(mesh=None) -> bool:
  """Whether a paged cache for ``mesh`` should be kept interleaved (``qwen2.PagedKVCache.init(
  interleaved=)``): on TPU, where ``ragged_paged_attention`` reads that layout."""
  return target_platform(mesh) == "tpu"


def _paged_attend(q, pages_k, pages_v, layer, row_valid, q_slots, table, span, dtype, block,
                  bounded, platform):
  """``cached`` for batch row i reading the pages ``table[i]`` of ``[L, P, page, K, hd]`` (or the
  interleaved layout), on one device. TPU with interleaved pages: ``kernels_tpu.paged_attention``
  (it reads each row's pages up to its last token, so ``span`` and ``bounded`` change nothing
  there; it takes a row's valid slots to be a prefix, as the engine keeps them). Otherwise
  ``blockwise``: a key block is whole pages, gathered for the batch's rows only. (The kernel is
  not run on split pages: building its layout at the call copies the page pool every layer,
  ~10x the live keys and values on v5p, more than ``blockwise`` reads; benchmarks/RESULTS.md.)"""
  mixed = interleaved(pages_v)
  if mixed and platform == "tpu":
    return kernels_tpu.paged_attention(q, pages_k, layer, q_slots, table, dtype)
  page = pages_k.shape[2]
  n_block = _page_block(span, page, block)

  def read(start, n):
    ids = jax.lax.dynamic_slice_in_dim(table, start // page, n // page, axis=1)   # [b, n / page]
    if mixed:
      kv = pages_k[layer, ids]                                                    # [b, m, page, 2K, hd]
      k, v = kv[..., 0::2, :], kv[..., 1::2, :]
    else:
      k, v = (c[layer, ids] for c in (pages_k, pages_v))                          # [b, m, page, K, hd]
    k, v = (c.reshape(c.shape[0], n, *c.shape[3:]) for c in (k, v))
    if dtype is not None and k.dtype != dtype:   # raw bits (interleaved pages hold values)
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v

  return _attend(q, read, row_valid, q_slots, span, n_block, bounded, platform)


def _write_pages(pages, layer, slots, x, table):
  """``pages [L, P, page, H, hd]`` with ``x [b, T, H, hd]`` at layer ``layer``, slots ``slots``
  of each row's pages ``table [b, S // page]`` (slots >= S dropped), on one device."""
  page = pages.shape[2]
  width = table.shape[1]
  row = jnp.arange(table.shape[0])[:, None]
  ids = table[row, jnp.minimum(slots // page, width - 1)]
  ids = jnp.where(slots < width * page, ids, pages.shape[1])   # past the pages: dropped
  return pages.at[layer, ids, slots % page].set(x, mode="drop")


def _write_interleaved(pages, layer, slots, k, v, table):
  """``_write_pages`` of keys and values ``[b, T, K, hd]`` (raw bits) into interleaved pages,
  which hold values (``qwen2.PagedKVCache``): only the new tokens are converted."""
  x = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3])
  return _write_pages(pages, layer, slots, jax.lax.bitcast_convert_type(x, pages.dtype), table)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table"],
                   meta_fields=["mesh", "batch_axis", "heads_axis"])
@dataclasses.dataclass(frozen=True)
class Pages:
  """A batch's rows in a paged cache (``qwen2.PagedKVCache``): ``table [n, S // page]`` the page
  ids of each batch row (shard-local, the rows laid out over ``batch_axis`` as ``Rows``'s are),
  pages ``[L, P, page, K, hd]`` (keys and values apart, or ``interleaved``: ``[L, P, page, 2K,
  hd]``) sharded over the same axis. Every access runs per device under ``shard_map``: a shard
  writes and reads its own pages only. Reads of interleaved pages go through
  ``ragged_paged_attention`` on TPU; everything else through the portable path (plain JAX
  gathers of whole pages inside ``blockwise``; ``_paged_attend``)."""
  table: jax.Array
  mesh: Any = None
  batch_axis: Any = None
  heads_axis: Any = None

  def _local(self, fn, in_specs, out_specs):
    return _per_device(self.mesh, fn, in_specs, out_specs)

  def _pages_spec(self) -> P:
    return _kv_spec(self.batch_axis, self.heads_axis)

  def write(self, pages: jax.Array, layer: jax.Array, slots: jax.Array, x: jax.Array) -> jax.Array:
    """``pages`` with ``x [n, T, K, hd]`` written at layer ``layer``, each batch row's slots
    ``slots [n, T]`` (slots >= S dropped) at their page and offset."""
    b, h = self.batch_axis, self.heads_axis
    return self._local(_write_pages, (self._pages_spec(), P(), P(b), P(b, None, h), P(b)),
                       self._pages_spec())(pages, layer, slots, x, self.table)

  def write_kv(self, pages_k: jax.Array, pages_v: jax.Array, layer: jax.Array, slots: jax.Array,
               k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``write`` of keys ``k`` and values ``v`` ``[n, T, K, hd]``, into their own pages or, in the
    interleaved layout (``interleaved``), both into ``pages_k``."""
    if not interleaved(pages_v):
      return self.write(pages_k, layer, slots, k), self.write(pages_v, layer, slots, v)
    b, h = self.batch_axis, self.heads_axis
    x = P(b, None, h)
    return self._local(_write_interleaved, (self._pages_spec(), P(), P(b), x, x, P(b)),
                       self._pages_spec())(pages_k, layer, slots, k, v, self.table), pages_v

  def attend(self, q, pages_k, pages_v, layer, row_valid, q_slots, span, dtype=None, block=None,
             bounded=False, platform=None):
    """``cached`` over these rows' pages: ``q [n, T, K, G, hd]``, ``row_valid [n, S]``,
    ``q_slots [n, T]`` (``bounded``: see ``_attend``; ``platform`` None: the mesh's,
    ``target_platform``)."""
    b, h = self.batch_axis, self.heads_axis
    fn = functools.partial(_paged_attend, span=span, dtype=dtype, block=block, bounded=bounded,
                           platform=platform or target_platform(self.mesh))
    pages = self._pages_spec()
    return self._local(fn, (P(b, None, h), pages, pages, P(), P(b), P(b), P(b)),
                       P(b, None, h))(q, pages_k, pages_v, layer, row_valid, q_slots, self.table)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
           block: int | None = None) -> jax.Array:
  """Causal self-attention of a whole sequence (the uncached forward): query t of row b sees
  key s iff ``s <= t`` and ``valid[b, s]``. ``q [B, T, K, G, hd]``, ``k, v [B, T, K, hd]``,
  ``valid`` bool [B, T].

  Up to ``block`` tokens (default ``KV_BLOCK``): ``dense``. Longer: the queries in blocks of
  ``block`` (T padded up to a multiple), each attending through ``blockwise`` to the keys up to
  its end, under ``jax.checkpoint``, so neither the forward nor its gradient ever holds more than
  one query block's float32 scores ``[B, K, G, block, T]``; the backward recomputes a block's
  scores instead of keeping the ``[B, K, G, T, T]`` a dense softmax would. Equals ``dense`` up to
  float rounding. (cuDNN's fused causal attention would be faster on GPU; not used here since
  its padding mask must be a prefix per row, which this function does not assume.)
  """
  B, T, K, G, hd = q.shape
  n = KV_BLOCK if block is None else block
  if T <= n:
    return dense(q, k, v, valid[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None])
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
    return blockwise(jax.lax.dynamic_slice_in_dim(q, i * n, n, axis=1), read, visible,
                     blocks * n, n)

  out = jax.lax.map(query_block, jnp.arange(blocks))   # [blocks, B, n, K, G, hd]
  return jnp.moveaxis(out, 0, 1).reshape(B, blocks * n, K, G, hd)[:, :T]

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

Which of these runs is decided in one place, the table of ``jaxes.models.attention_dispatch``
(keyed by platform, cache kind and phase; the built-in entries are registered at the end of this
module). Every implementation reads the keys through a ``KeyView``. The model reaches its cache
through one interface, ``CacheAccess`` (``Dense``, ``Rows``, ``Pages``), inside one named pytree
per layer, ``LayerCache``. The platform is the one the program is compiled for
(``target_platform``: the mesh's devices), not the process's default backend, so a deviceless
compile for a GPU or TPU target from a CPU machine (the preflight) builds the program the real
run would.

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
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxes.models import attention_dispatch as dispatch
from jaxes.models import kernels_tpu

# A finite floor (not -inf) keeps rows without any visible key (padding) free of NaN.
_FLOOR = float(jnp.finfo(jnp.float32).min)
KV_BLOCK = 512  # keys per block (read at trace time, so tests can shrink it)
# Keys per block of a bounded read (``KeyView.bounded``: the engine's) by platform, at most
# ``KV_BLOCK``: such a read stops at the block holding the furthest query, so its cost follows
# the live tokens to within a block. On the CPU the cost per key is flat from 32- to 512-key
# blocks (0.37-0.39 us per key, row and layer at SmolLM2's heads, one thread) and a 512-key block
# would be most of a 135M model's decode step while rows are short (benchmarks/RESULTS.md,
# "Decode on CPU"). Elsewhere ``KV_BLOCK``: an accelerator pays per loop iteration.
BOUNDED_KV_BLOCK = {"cpu": 64}


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
    return dispatch.platform_name(mesh.devices.flat[0].platform)
  device = jax.sharding.get_abstract_mesh().abstract_device
  return dispatch.platform_name(jax.default_backend() if device is None else device.platform)


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s raw bits as unsigned ints of its width (a free bitcast)."""
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


@dataclasses.dataclass(frozen=True)
class KeyView:
  """What an attention implementation reads, on one device (built inside the trace, per layer):
  ``read(start, n) -> (k, v)`` each ``[n_rows, n, K, hd]`` in the compute dtype, key slots
  ``[start, start + n)`` of each batch row (``start`` may be traced); ``valid [n_rows, S]`` and
  ``q_slots [n_rows, T]``: query t of row b sees slot s iff ``valid[b, s]`` and
  ``s <= q_slots[b, t]``; keys ``[0, span)`` only. ``block``: keys per block of ``blockwise``
  (None: ``KV_BLOCK``); ``page``: the keys are read in whole pages of this many (blocks round to
  pages). ``bounded``: no query sees a slot past the furthest ``q_slots`` (padding tokens point
  at slot 0), so blocks after it need not be read. ``pages``, ``table``, ``layer``, ``dtype``:
  a paged cache's raw storage, for a kernel that reads it itself (``kernels_tpu``)."""
  read: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]
  valid: jax.Array
  q_slots: jax.Array | None
  span: int
  block: int | None = None
  bounded: bool = False
  page: int | None = None
  pages: jax.Array | None = None
  table: jax.Array | None = None
  layer: jax.Array | None = None
  dtype: Any = None

  def visible(self, start, n) -> jax.Array:
    """bool ``[n_rows, T, n]``: which of the slots ``[start, start + n)`` each query sees."""
    keys = start + jnp.arange(n)
    return (jax.lax.dynamic_slice_in_dim(self.valid, start, n, axis=1)[:, None, :]
            & (keys[None, None, :] <= self.q_slots[:, :, None]))

  def key_block(self) -> int | None:
    """Keys per ``blockwise`` block: ``block``, or whole pages as many as fit in it."""
    return self.block if self.page is None else _page_block(self.span, self.page, self.block)


def _blockwise_cached(q: jax.Array, keys: KeyView) -> jax.Array:
  """``blockwise`` over a cache (``bounded``: up to this device's furthest query only)."""
  return blockwise(q, keys.read, keys.visible, keys.span, keys.key_block(),
                   keys_needed=keys.q_slots.max() + 1 if keys.bounded else None)


def _cudnn_cached(q: jax.Array, keys: KeyView) -> jax.Array:
  """cuDNN over the whole span; where cuDNN refuses the call (or is not installed),
  ``blockwise``."""
  k, v = keys.read(0, keys.span)
  out = _cudnn(q, k, v, keys.visible(0, keys.span))
  return _blockwise_cached(q, keys) if out is None else out


def _ragged_paged(q: jax.Array, keys: KeyView) -> jax.Array:
  """``kernels_tpu.paged_attention`` over interleaved pages: it reads each row's pages up to its
  last token, so ``span`` and ``bounded`` change nothing; it takes a row's valid slots to be a
  prefix, as the engine keeps them."""
  return kernels_tpu.paged_attention(q, keys.pages, keys.layer, keys.q_slots, keys.table,
                                     keys.dtype)


def _causal_sequence(q: jax.Array, keys: KeyView) -> jax.Array:
  """``causal`` over a whole sequence's own keys (no cache)."""
  k, v = keys.read(0, keys.span)
  return causal(q, k, v, keys.valid, keys.block)


def cached(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
           cache_valid: jax.Array, q_slots: jax.Array, span: int, dtype=None,
           block: int | None = None, bounded: bool = False, platform: str | None = None,
           phase: str = "mixed") -> jax.Array:
  """Attention of ``q`` to the first ``span`` slots of layer ``layer`` of a ``[L, B, S, K, hd]``
  cache; query t of row b sees slot s iff ``cache_valid[b, s]`` and ``s <= q_slots[b, t]``.
  ``dtype``: the cache holds raw bits (``as_bits``) of this dtype; None: plain values. Blocks
  are read as bits and converted one at a time, so no compiler can hoist a dtype conversion of
  the whole cache out of the block loop (the CPU backend, which computes bfloat16 dots in
  float32, did: a float32 copy of the cache). ``bounded``: read key blocks up to the furthest
  query only (``KeyView``). ``platform``: the target's (None: ``target_platform()``); with the
  ``phase``, it picks the implementation (``attention_dispatch``)."""
  B = q.shape[0]
  K, hd = cache_k.shape[-2:]

  def read(start, n):
    at = (layer, 0, start, 0, 0)
    size = (1, B, n, K, hd)
    k, v = (jax.lax.dynamic_slice(c, at, size)[0] for c in (cache_k, cache_v))
    if dtype is not None:
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v

  return _attend(q, KeyView(read, cache_valid, q_slots, span, block, bounded),
                 target_platform() if platform is None else platform, "dense", phase)


def _attend_rows(q, cache_k, cache_v, layer, row_valid, q_slots, index, span, dtype, block,
                 bounded, platform, phase):
  """``cached`` for batch row i reading cache row ``index[i]``, all on one device: each key block
  is gathered for the batch's rows only (``[n, block, K, hd]``), never their whole rows."""
  def read(start, n):
    keys = (start + jnp.arange(n))[None, :]
    k, v = (c[layer, index[:, None], keys] for c in (cache_k, cache_v))
    if dtype is not None:
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v

  return _attend(q, KeyView(read, row_valid, q_slots, span, block, bounded), platform, "dense",
                 phase)


def _attend(q: jax.Array, keys: KeyView, platform: str, cache: str, phase: str) -> jax.Array:
  """Attention of ``q`` to ``keys`` by the implementation the dispatch table names (a bounded
  read in the platform's ``BOUNDED_KV_BLOCK``)."""
  bounded = BOUNDED_KV_BLOCK.get(platform)
  # Only where it tiles the span: blocks divide it, and a span with no divisor near the bound
  # would be read in many tiny blocks.
  if keys.bounded and bounded and (keys.span <= bounded or keys.span % bounded == 0):
    block = KV_BLOCK if keys.block is None else keys.block
    keys = dataclasses.replace(keys, block=min(block, bounded))
  return dispatch.choose(platform, cache, phase).fn(q, keys)


def _per_device(mesh, fn, in_specs, out_specs):
  """``fn`` run on each device's shards under ``shard_map`` (``mesh`` None: ``fn`` itself)."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _kv_spec(batch_axis, heads_axis) -> P:
  """``[L, rows or pages, tokens, K, hd]`` keys or values: rows over ``batch_axis``, KV heads
  over ``heads_axis``."""
  return P(None, batch_axis, None, heads_axis, None)


class CacheAccess(Protocol):
  """How a batch reaches a KV cache: the one interface the model uses (``LayerCache``, and
  ``qwen2.Qwen2ForCausalLM`` for a call's bookkeeping). The cache is per-row arrays ``index
  [B]``, ``valid [B, S]`` and key/value buffers ``[L, rows or pages, ...]``; the batch is ``n``
  rows of tokens. Implemented by ``Dense`` (batch row b is cache row b), ``Rows`` (some rows of
  a sharded cache, per device) and ``Pages`` (a paged cache, per device)."""

  names_rows: bool   # batch rows name their cache rows, so several may share one (ragged)

  def take(self, x: jax.Array) -> jax.Array:
    """A per-cache-row array ``[B, ...]`` -> each batch row's ``[n, ...]``."""

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    """``valid [B, S]`` with the slots ``[n, T]`` of each batch row's cache row set."""

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    """``index [B]`` plus ``counts [n]`` at each batch row's cache row."""

  def write_kv(self, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, slots: jax.Array,
               k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The buffers with keys and values ``[n, T, K, hd]`` (raw bits) written at layer ``layer``,
    slots ``slots [n, T]`` of each batch row's cache row (slots >= S dropped)."""

  def attend(self, q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
             valid: jax.Array, q_slots: jax.Array, span: int, dtype=None,
             block: int | None = None, bounded: bool = False, platform: str | None = None,
             phase: str = "mixed") -> jax.Array:
    """Attention of ``q [n, T, K, G, hd]`` to layer ``layer`` (see ``cached``)."""


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Dense:
  """``CacheAccess`` where batch row b is cache row b of ``[L, B, S, K, hd]`` buffers, as one
  program over the whole batch (no ``shard_map``: the partitioner places it)."""
  names_rows = False

  def take(self, x: jax.Array) -> jax.Array:
    return x

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    rows = jnp.arange(slots.shape[0])[:, None]
    return valid.at[rows, slots].set(True, mode="drop")

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    return index + counts

  def write_kv(self, cache_k, cache_v, layer, slots, k, v):
    rows = jnp.arange(slots.shape[0])[:, None]
    return (cache_k.at[layer, rows, slots].set(k, mode="drop"),
            cache_v.at[layer, rows, slots].set(v, mode="drop"))

  def attend(self, q, cache_k, cache_v, layer, valid, q_slots, span, dtype=None, block=None,
             bounded=False, platform=None, phase="mixed"):
    return cached(q, cache_k, cache_v, layer, valid, q_slots, span, dtype, block, bounded,
                  platform, phase)


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
  names_rows = True   # ``CacheAccess``

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

  def write_kv(self, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array, slots: jax.Array,
               k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``write`` of keys ``k`` and values ``v`` ``[n, T, K, hd]``."""
    return self.write(cache_k, layer, slots, k), self.write(cache_v, layer, slots, v)

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
             bounded=False, platform=None, phase="mixed"):
    """``cached`` for these rows: ``q [n, T, K, G, hd]``, ``row_valid [n, S]``, ``q_slots [n, T]``
    (``bounded``: see ``KeyView``; ``platform`` None: the mesh's, ``target_platform``)."""
    b, h = self.batch_axis, self.heads_axis
    fn = functools.partial(_attend_rows, span=span, dtype=dtype, block=block, bounded=bounded,
                           platform=platform or target_platform(self.mesh), phase=phase)
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
  interleaved=)``): where the dispatch table reads that layout with an implementation of its
  own (TPU: ``ragged_paged_attention``); elsewhere split pages read the same way."""
  platform = target_platform(mesh)
  return any(dispatch.choose(platform, "paged_interleaved", phase)
             is not dispatch.choose(platform, "paged", phase) for phase in dispatch.PHASES)


def _paged_attend(q, pages_k, pages_v, layer, row_valid, q_slots, table, span, dtype, block,
                  bounded, platform, phase):
  """``cached`` for batch row i reading the pages ``table[i]`` of ``[L, P, page, K, hd]`` (or the
  interleaved layout), on one device, by the table's implementation for the layout (TPU with
  interleaved pages: ``kernels_tpu.paged_attention``; else ``blockwise`` with a key block of
  whole pages, gathered for the batch's rows only). (The kernel is not run on split pages:
  building its layout at the call copies the page pool every layer, ~10x the live keys and
  values on v5p, more than ``blockwise`` reads; benchmarks/RESULTS.md.)"""
  mixed = interleaved(pages_v)
  page = pages_k.shape[2]

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

  keys = KeyView(read, row_valid, q_slots, span, block, bounded, page=page, pages=pages_k,
                 table=table, layer=layer, dtype=dtype)
  return _attend(q, keys, platform, "paged_interleaved" if mixed else "paged", phase)


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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table", "rows"],
                   meta_fields=["mesh", "batch_axis", "heads_axis"])
@dataclasses.dataclass(frozen=True)
class Pages:
  """A batch's rows in a paged cache (``qwen2.PagedKVCache``): ``table [n, S // page]`` the page
  ids of each batch row (shard-local, the rows laid out over ``batch_axis`` as ``Rows``'s are),
  pages ``[L, P, page, K, hd]`` (keys and values apart, or ``interleaved``: ``[L, P, page, 2K,
  hd]``) sharded over the same axis. Every access runs per device under ``shard_map``: a shard
  writes and reads its own pages only. Reads of interleaved pages go through
  ``ragged_paged_attention`` on TPU; everything else through the portable path (plain JAX
  gathers of whole pages inside ``blockwise``; ``_paged_attend``). ``rows``: which cache rows
  the batch rows are, for the per-row ``index`` and ``valid`` (``Rows``; None: ``Dense``)."""
  table: jax.Array
  mesh: Any = None
  batch_axis: Any = None
  heads_axis: Any = None
  rows: Any = None

  def _local(self, fn, in_specs, out_specs):
    return _per_device(self.mesh, fn, in_specs, out_specs)

  def _rows(self) -> CacheAccess:
    return Dense() if self.rows is None else self.rows

  @property
  def names_rows(self) -> bool:   # ``CacheAccess``
    return self._rows().names_rows

  def take(self, x: jax.Array) -> jax.Array:
    return self._rows().take(x)

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    return self._rows().mark(valid, slots)

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    return self._rows().advance(index, counts)

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
             bounded=False, platform=None, phase="mixed"):
    """``cached`` over these rows' pages: ``q [n, T, K, G, hd]``, ``row_valid [n, S]``,
    ``q_slots [n, T]`` (``bounded``: see ``KeyView``; ``platform`` None: the mesh's,
    ``target_platform``)."""
    b, h = self.batch_axis, self.heads_axis
    fn = functools.partial(_paged_attend, span=span, dtype=dtype, block=block, bounded=bounded,
                           platform=platform or target_platform(self.mesh), phase=phase)
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


def attend_sequence(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                    platform: str | None = None) -> jax.Array:
  """Causal self-attention of a whole sequence (no cache) by the dispatch table's implementation:
  ``q [B, T, K, G, hd]``, ``k, v [B, T, K, hd]``, ``valid`` bool [B, T] (see ``causal``)."""
  def read(start, n):
    if isinstance(start, int) and start == 0 and n == k.shape[1]:
      return k, v   # the whole sequence, as is (no slice in the program)
    return (jax.lax.dynamic_slice_in_dim(k, start, n, axis=1),
            jax.lax.dynamic_slice_in_dim(v, start, n, axis=1))
  return _attend(q, KeyView(read, valid, None, k.shape[1]),
                 target_platform() if platform is None else platform, "none", "prefill")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "valid", "q_slots", "write_slots", "access"],
                   meta_fields=["span", "dtype", "bounded", "phase"])
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """The KV cache as one decoder layer sees it, a named pytree. ``k, v``: the whole cache's
  buffers (every layer; raw bits of ``dtype``, or interleaved pages holding values), which a
  layer scan carries and each layer writes into in place. Per batch row: ``valid [n, S]`` (the
  slots a query may see), ``q_slots [n, T]`` (each query's own slot; it sees the valid slots up
  to it), ``write_slots [n, T]`` (where each token's keys go; padding: past the cache, dropped).
  ``access``: how the batch reaches the buffers (``CacheAccess``). Static: ``span`` (queries see
  the first ``span`` slots only), ``dtype``, ``bounded`` (``KeyView``), ``phase``
  (``attention_dispatch``)."""
  k: jax.Array
  v: jax.Array
  valid: jax.Array
  q_slots: jax.Array
  write_slots: jax.Array
  access: Any
  span: int
  dtype: Any
  bounded: bool = False
  phase: str = "mixed"

  def write(self, layer: jax.Array, k: jax.Array, v: jax.Array) -> "LayerCache":
    """This cache with the new keys and values ``[n, T, K, hd]`` (compute dtype) written at
    layer ``layer``: only the new tokens are converted to the cache's bits."""
    cache_k, cache_v = self.access.write_kv(self.k, self.v, layer, self.write_slots,
                                            as_bits(k.astype(self.dtype)),
                                            as_bits(v.astype(self.dtype)))
    return dataclasses.replace(self, k=cache_k, v=cache_v)

  def attend(self, q: jax.Array, layer: jax.Array) -> jax.Array:
    """Attention of ``q [n, T, K, G, hd]`` to layer ``layer`` of this cache."""
    return self.access.attend(q, self.k, self.v, layer, self.valid, self.q_slots, self.span,
                              self.dtype, bounded=self.bounded, phase=self.phase)


def attention_spans(max_len: int, mesh=None, paged: bool = False) -> list[int]:
  """The attention spans (``qwen2.Options.attend_len``) an engine over rows of ``max_len`` slots
  on ``mesh`` compiles a program for. One, the whole row, where the implementation reads key
  blocks up to the call's furthest token only (one span serves every length); where it reads the
  whole span it is handed (cuDNN), three prefixes of the rows, so a step attends to the shortest
  one that holds every row and short episodes do not pay for the longest one the cache allows."""
  platform = target_platform(mesh)
  cache = ("paged_interleaved" if interleave_pages(mesh) else "paged") if paged else "dense"
  whole = any(dispatch.choose(platform, cache, phase).reads_whole_span
              for phase in ("mixed", "decode"))
  return sorted({max(max_len >> k, 1) for k in range(3 if whole else 1)})


# The dispatch table's entries: (platform, cache kind, phase) -> implementation ("*": any).
# Shipped kernels where JAX has one that fits: cuDNN's flash attention through
# jax.nn.dot_product_attention, Pallas' TPU ragged_paged_attention (kernels_tpu). ``blockwise``
# and ``causal`` are hand-written because no shipped kernel takes this cache's queries at a
# per-row slot offset, mixed decode and prefill rows, and a validity mask over every backend
# (the module docstring says why not each Pallas kernel).
BLOCKWISE = dispatch.Implementation("blockwise", _blockwise_cached)
CUDNN = dispatch.Implementation("cuDNN", _cudnn_cached, reads_whole_span=True)
dispatch.register("*", "none", "*", dispatch.Implementation("causal", _causal_sequence))
dispatch.register("*", "dense", "*", BLOCKWISE)
dispatch.register("*", "paged", "*", BLOCKWISE)
dispatch.register("*", "paged_interleaved", "*", BLOCKWISE)
dispatch.register("gpu", "dense", "*", CUDNN)
dispatch.register("gpu", "paged", "*", CUDNN)
dispatch.register("gpu", "paged_interleaved", "*", CUDNN)
dispatch.register("tpu", "paged_interleaved", "*",
                  dispatch.Implementation("ragged_paged_attention", _ragged_paged))

"""The paged kind of ``rows.CacheAccess``: ``Pages``, a batch's rows in a paged cache
(``qwen2.PagedKVCache``), written and read per device through each row's page table."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxes.models.attention import dispatch
from jaxes.models.attention.keys import KeyView, StoredPages
from jaxes.models.attention.rows import CacheAccess, Dense, kv_spec, per_device


def write_pages(pages, layer, slots, x, table):
  """``pages [L, P, page, H, hd]`` with ``x [b, T, H, hd]`` at layer ``layer``, slots ``slots``
  of each row's pages ``table [b, S // page]`` (slots >= S dropped), on one device."""
  page = pages.shape[2]
  width = table.shape[1]
  row = jnp.arange(table.shape[0])[:, None]
  ids = table[row, jnp.minimum(slots // page, width - 1)]
  ids = jnp.where(slots < width * page, ids, pages.shape[1])   # past the pages: dropped
  return pages.at[layer, ids, slots % page].set(x, mode="drop")


def write_interleaved(pages, layer, slots, k, v, table):
  """``write_pages`` of keys and values ``[b, T, K, hd]`` (raw bits) into interleaved pages,
  which hold values (``qwen2.PagedKVCache``): only the new tokens are converted."""
  x = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3])
  return write_pages(pages, layer, slots, jax.lax.bitcast_convert_type(x, pages.dtype), table)


def page_reader(buffers, layer, table, dtype):
  """``read(start, n)`` of key slots ``[start, start + n)`` (whole pages) of each row's pages
  ``table [b, S // page]`` at layer ``layer`` of split or interleaved pages, on one device:
  gathered for the batch's rows only; converted from raw bits of ``dtype`` where they are bits
  (interleaved pages hold values)."""
  pages_k, pages_v = buffers
  mixed = dispatch.interleaved(pages_v)
  page = pages_k.shape[2]

  def read(start, n):
    ids = jax.lax.dynamic_slice_in_dim(table, start // page, n // page, axis=1)  # [b, n / page]
    if mixed:
      kv = pages_k[layer, ids]                                     # [b, m, page, 2K, hd]
      k, v = kv[..., 0::2, :], kv[..., 1::2, :]
    else:
      k, v = (c[layer, ids] for c in (pages_k, pages_v))           # [b, m, page, K, hd]
    k, v = (c.reshape(c.shape[0], n, *c.shape[3:]) for c in (k, v))
    if dtype is not None and k.dtype != dtype:   # raw bits (interleaved pages hold values)
      k, v = (jax.lax.bitcast_convert_type(c, dtype) for c in (k, v))
    return k, v
  return read


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table", "rows"],
                   meta_fields=["mesh", "batch_axis", "heads_axis"])
@dataclasses.dataclass(frozen=True)
class Pages:
  """A batch's rows in a paged cache (``qwen2.PagedKVCache``): ``table [n, S // page]`` the page
  ids of each batch row (shard-local, the rows laid out over ``batch_axis`` as ``Rows``'s are),
  pages ``[L, P, page, K, hd]`` (keys and values apart, or ``dispatch.interleaved``: ``[L, P,
  page, 2K, hd]``) sharded over the same axis. Every access runs per device under
  ``shard_map``: a shard writes and reads its own pages only. Which implementation reads them is
  the table's (TPU with interleaved pages: ``ragged_paged_attention``; GPU: cuDNN over the
  gathered pages; else ``blockwise`` with a key block of whole pages, gathered for the batch's
  rows only). ``rows``: which cache rows the batch rows are, for the per-row ``index`` and
  ``valid`` (``Rows``; None: ``Dense``)."""
  table: jax.Array
  mesh: Any = None
  batch_axis: Any = None
  heads_axis: Any = None
  rows: Any = None

  @property
  def platform(self) -> str:   # ``CacheAccess``
    return dispatch.target_platform(self.mesh)

  def cache_kind(self, v: jax.Array) -> str:
    return "paged_interleaved" if dispatch.interleaved(v) else "paged"

  def _local(self, fn, in_specs, out_specs):
    return per_device(self.mesh, fn, in_specs, out_specs)

  def _rows(self) -> CacheAccess:
    return Dense() if self.rows is None else self.rows

  @property
  def names_rows(self) -> bool:
    return self._rows().names_rows

  def take(self, x: jax.Array) -> jax.Array:
    return self._rows().take(x)

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    return self._rows().mark(valid, slots)

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    return self._rows().advance(index, counts)

  def _write_one(self, pages: jax.Array, layer: jax.Array, slots: jax.Array,
                x: jax.Array) -> jax.Array:
    """``pages`` with ``x [n, T, K, hd]`` written at layer ``layer``, each batch row's slots
    ``slots [n, T]`` (slots >= S dropped) at their page and offset."""
    b, h = self.batch_axis, self.heads_axis
    spec = kv_spec(b, h)
    return self._local(write_pages, (spec, P(), P(b), P(b, None, h), P(b)), spec)(
        pages, layer, slots, x, self.table)

  def write(self, cache, layer, k, v):
    """Keys ``k`` and values ``v`` ``[n, T, K, hd]`` into their own pages or, in the interleaved
    layout, both into ``cache.k``."""
    slots = cache.addressing.write_slots
    if not dispatch.interleaved(cache.v):
      return self._write_one(cache.k, layer, slots, k), self._write_one(cache.v, layer, slots, v)
    b, h = self.batch_axis, self.heads_axis
    x, spec = P(b, None, h), kv_spec(b, h)
    return self._local(write_interleaved, (spec, P(), P(b), x, x, P(b)), spec)(
        cache.k, layer, slots, k, v, self.table), cache.v

  def attend(self, q, cache, layer):
    """Batch row i reads the pages ``table[i]``, per device, by the cache's implementation (a
    ``KeyView`` reading whole pages, ``StoredPages`` for a kernel that reads them itself). (The
    kernel is not run on split pages: building its layout at the call copies the page pool every
    layer, ~10x the live keys and values on v5p, more than ``blockwise`` reads;
    benchmarks/RESULTS.md.)"""
    b, h = self.batch_axis, self.heads_axis

    def local(q, buffers, layer, rows):
      valid, q_slots, table = rows
      addressing = dataclasses.replace(cache.addressing, valid=valid, q_slots=q_slots,
                                       write_slots=None)
      keys = KeyView(page_reader(buffers, layer, table, cache.dtype), addressing,
                     page=buffers[0].shape[2],
                     stored=StoredPages(buffers[0], table, layer, cache.dtype))
      return cache.impl.fn(q, keys)

    spec, at = kv_spec(b, h), cache.addressing
    in_specs = (P(b, None, h), (spec, spec), P(), (P(b), P(b), P(b)))
    return self._local(local, in_specs, P(b, None, h))(
        q, (cache.k, cache.v), layer, (at.valid, at.q_slots, self.table))

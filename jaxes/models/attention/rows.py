"""How a batch reaches a KV cache, one interface (``CacheAccess``), and its unpaged kinds:
``Dense`` (batch row b is cache row b) and ``Rows`` (some rows of a sharded cache, per device).
``pages.Pages`` is the paged kind."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxes.models.attention import dispatch
from jaxes.models.attention.keys import KeyView


def per_device(mesh, fn, in_specs, out_specs):
  """``fn`` run on each device's shards under ``shard_map`` (``mesh`` None: ``fn`` itself)."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def kv_spec(batch_axis, heads_axis) -> P:
  """``[L, rows or pages, tokens, K, hd]`` keys or values: rows over ``batch_axis``, KV heads
  over ``heads_axis``."""
  return P(None, batch_axis, None, heads_axis, None)


class CacheAccess(Protocol):
  """How a batch reaches a KV cache: the one interface the model uses (``cache.LayerCache``, and
  ``qwen2.Qwen2ForCausalLM`` for a call's bookkeeping). The cache is per-row arrays ``index
  [B]``, ``valid [B, S]`` and key/value buffers ``[L, rows or pages, ...]``; the batch is ``n``
  rows of tokens. Implemented by ``Dense``, ``Rows`` and ``pages.Pages``. ``write`` and
  ``attend`` take the layer's cache (``cache.LayerCache``: the buffers, the call's
  ``Addressing`` and its implementation) and the layer."""

  names_rows: bool   # batch rows name their cache rows, so several may share one (ragged)

  @property
  def platform(self) -> str:
    """The platform the accesses run on (``dispatch.target_platform``)."""

  def cache_kind(self, v: jax.Array) -> str:
    """The dispatch table's cache kind of buffers whose values are ``v``."""

  def take(self, x: jax.Array) -> jax.Array:
    """A per-cache-row array ``[B, ...]`` -> each batch row's ``[n, ...]``."""

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    """``valid [B, S]`` with the slots ``[n, T]`` of each batch row's cache row set."""

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    """``index [B]`` plus ``counts [n]`` at each batch row's cache row."""

  def write(self, cache, layer: jax.Array, k: jax.Array,
            v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cache``'s buffers with keys and values ``[n, T, K, hd]`` (raw bits) written at layer
    ``layer``, at the call's ``write_slots`` of each batch row's cache row (>= S dropped)."""

  def attend(self, q: jax.Array, cache, layer: jax.Array) -> jax.Array:
    """Attention of ``q [n, T, K, G, hd]`` to layer ``layer`` of ``cache``."""


def bits_as(x: jax.Array, dtype) -> jax.Array:
  """Raw bits ``x`` read as ``dtype`` (None: ``x`` holds values)."""
  return x if dtype is None else jax.lax.bitcast_convert_type(x, dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Dense:
  """``CacheAccess`` where batch row b is cache row b of ``[L, B, S, K, hd]`` buffers, as one
  program over the whole batch (no ``shard_map``: the partitioner places it)."""
  names_rows = False

  @property
  def platform(self) -> str:
    return dispatch.target_platform()

  def cache_kind(self, v: jax.Array) -> str:
    return "dense"

  def take(self, x: jax.Array) -> jax.Array:
    return x

  def mark(self, valid: jax.Array, slots: jax.Array) -> jax.Array:
    rows = jnp.arange(slots.shape[0])[:, None]
    return valid.at[rows, slots].set(True, mode="drop")

  def advance(self, index: jax.Array, counts: jax.Array) -> jax.Array:
    return index + counts

  def write(self, cache, layer, k, v):
    slots = cache.addressing.write_slots
    rows = jnp.arange(slots.shape[0])[:, None]
    return (cache.k.at[layer, rows, slots].set(k, mode="drop"),
            cache.v.at[layer, rows, slots].set(v, mode="drop"))

  def attend(self, q, cache, layer):
    """Slices key blocks of layer ``layer`` straight out of the ``[L, B, S, K, hd]`` buffers.
    Blocks are read as bits and converted one at a time, so no compiler can hoist a dtype
    conversion of the whole cache out of the block loop (the CPU backend, which computes
    bfloat16 dots in float32, did: a float32 copy of the cache)."""
    B = q.shape[0]
    K, hd = cache.k.shape[-2:]

    def read(start, n):
      at = (layer, 0, start, 0, 0)
      size = (1, B, n, K, hd)
      k, v = (jax.lax.dynamic_slice(c, at, size)[0] for c in (cache.k, cache.v))
      return bits_as(k, cache.dtype), bits_as(v, cache.dtype)

    return cache.impl.fn(q, KeyView(read, cache.addressing))


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

  @property
  def platform(self) -> str:
    return dispatch.target_platform(self.mesh)

  def cache_kind(self, v: jax.Array) -> str:
    return "dense"

  def _local(self, fn, in_specs, out_specs):
    return per_device(self.mesh, fn, in_specs, out_specs)

  def take(self, x: jax.Array) -> jax.Array:
    """``x [B, ...]`` (rows over ``batch_axis``, the rest whole) -> ``[n, ...]``."""
    rows = P(self.batch_axis)
    return self._local(lambda x, i: x[i], (rows, rows), rows)(x, self.index)

  def _write_one(self, buffer: jax.Array, layer: jax.Array, slots: jax.Array,
                x: jax.Array) -> jax.Array:
    """``buffer [L, B, S, K, hd]`` with ``x [n, T, K, hd]`` written at layer ``layer``, row
    ``index[i]``, slots ``slots [n, T]`` (slots >= S dropped): only the new tokens move."""
    b, h = self.batch_axis, self.heads_axis
    def fn(buffer, layer, slots, x, i):
      return buffer.at[layer, i[:, None], slots].set(x, mode="drop")
    spec = kv_spec(b, h)
    return self._local(fn, (spec, P(), P(b), P(b, None, h), P(b)), spec)(
        buffer, layer, slots, x, self.index)

  def write(self, cache, layer, k, v):
    slots = cache.addressing.write_slots
    return self._write_one(cache.k, layer, slots, k), self._write_one(cache.v, layer, slots, v)

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

  def attend(self, q, cache, layer):
    """Batch row i reads cache row ``index[i]``, per device: each key block is gathered for the
    batch's rows only (``[n, block, K, hd]``), never their whole rows."""
    b, h = self.batch_axis, self.heads_axis

    def local(q, buffers, layer, rows):
      valid, q_slots, index = rows

      def read(start, n):
        keys = (start + jnp.arange(n))[None, :]
        k, v = (c[layer, index[:, None], keys] for c in buffers)
        return bits_as(k, cache.dtype), bits_as(v, cache.dtype)

      addressing = dataclasses.replace(cache.addressing, valid=valid, q_slots=q_slots,
                                       write_slots=None)
      return cache.impl.fn(q, KeyView(read, addressing))

    spec, at = kv_spec(b, h), cache.addressing
    in_specs = (P(b, None, h), (spec, spec), P(), (P(b), P(b), P(b)))
    return self._local(local, in_specs, P(b, None, h))(
        q, (cache.k, cache.v), layer, (at.valid, at.q_slots, self.index))

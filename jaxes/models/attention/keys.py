"""What an attention implementation reads: a call's ``Addressing`` (which slots each query sees,
how far keys are read: one pytree per call of the model, carried with its cache) and, per layer
and device, a ``KeyView`` (the keys and values of those slots, read a block at a time)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxes.models.attention import softmax

# Keys per block of a bounded read (``Addressing.bounded``: the engine's) by platform, at most
# ``softmax.KV_BLOCK``: such a read stops at the block holding the furthest query, so its cost
# follows the live tokens to within a block. On the CPU the cost per key is flat from 32- to
# 512-key blocks (0.37-0.39 us per key, row and layer at SmolLM2's heads, one thread) and a
# 512-key block would be most of a 135M model's decode step while rows are short
# (benchmarks/RESULTS.md, "Decode on CPU"). Elsewhere ``KV_BLOCK``: an accelerator pays per loop
# iteration.
BOUNDED_KV_BLOCK = {"cpu": 64}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["valid", "q_slots", "write_slots"],
                   meta_fields=["span", "bounded", "block"])
@dataclasses.dataclass(frozen=True)
class Addressing:
  """Where a call's tokens are in the cache, per batch row: ``valid [n, S]`` (the slots a query
  may see), ``q_slots [n, T]`` (each query's own slot; query t of row b sees slot s iff
  ``valid[b, s]`` and ``s <= q_slots[b, t]``), ``write_slots [n, T]`` (where each token's keys
  go; padding: past the cache, dropped; None for a read only). Static: ``span`` (queries see the
  first ``span`` slots only), ``bounded`` (no query sees a slot past the furthest ``q_slots``, padding tokens pointing
  at slot 0, so key blocks after it need not be read), ``block`` (keys per ``blockwise`` block;
  None: ``softmax.KV_BLOCK``). The batch rows' cache rows or pages are the access's
  (``rows.Rows``, ``pages.Pages``)."""
  valid: jax.Array
  q_slots: jax.Array | None
  span: int
  write_slots: jax.Array | None = None
  bounded: bool = False
  block: int | None = None

  def for_platform(self, platform: str) -> "Addressing":
    """This addressing with a bounded read's key block for ``platform`` (``BOUNDED_KV_BLOCK``),
    only where it tiles the span: blocks divide it, and a span with no divisor near the bound
    would be read in many tiny blocks."""
    bound = BOUNDED_KV_BLOCK.get(platform)
    if not (self.bounded and bound and (self.span <= bound or self.span % bound == 0)):
      return self
    block = softmax.KV_BLOCK if self.block is None else self.block
    return dataclasses.replace(self, block=min(block, bound))


@dataclasses.dataclass(frozen=True)
class StoredPages:
  """A paged cache's raw storage, for a kernel that reads it itself (``kernels_tpu``): ``pages``
  (every layer), this device's ``table``, the ``layer``, and ``dtype`` (raw bits of it; None:
  values)."""
  pages: jax.Array
  table: jax.Array
  layer: jax.Array
  dtype: Any = None


@dataclasses.dataclass(frozen=True)
class KeyView:
  """What an attention implementation reads, on one device (built inside the trace, per layer):
  ``read(start, n) -> (k, v)`` each ``[n_rows, n, K, hd]`` in the compute dtype, key slots
  ``[start, start + n)`` of each batch row (``start`` may be traced), which ``addressing`` (this
  device's rows) says the queries see, keys ``[0, span)`` only. ``page``: the keys are read in
  whole pages of this many (blocks round to pages); ``stored``: the pages as stored."""
  read: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]
  addressing: Addressing
  page: int | None = None
  stored: StoredPages | None = None

  @property
  def span(self) -> int:
    return self.addressing.span

  def visible(self, start, n) -> jax.Array:
    """bool ``[n_rows, T, n]``: which of the slots ``[start, start + n)`` each query sees."""
    keys = start + jnp.arange(n)
    return (jax.lax.dynamic_slice_in_dim(self.addressing.valid, start, n, axis=1)[:, None, :]
            & (keys[None, None, :] <= self.addressing.q_slots[:, :, None]))

  def key_block(self) -> int | None:
    """Keys per ``blockwise`` block: ``block``, or whole pages as many as fit in it."""
    block = self.addressing.block
    return block if self.page is None else page_block(self.span, self.page, block)

  def keys_needed(self) -> jax.Array | None:
    """Keys up to this device's furthest query where the read is bounded (None: the span)."""
    return self.addressing.q_slots.max() + 1 if self.addressing.bounded else None


def page_block(span: int, page: int, block: int | None) -> int:
  """Keys per block of a paged read: whole pages, as many as fit in ``block`` and tile ``span``."""
  if span % page:
    raise ValueError(f"attention span {span} is not a multiple of the page size {page}")
  return page * softmax.block_size(span // page,
                                   max(1, (softmax.KV_BLOCK if block is None else block) // page))

"""The dispatch table's built-in entries and the implementations they name, each ``fn(q, keys)``
over a ``keys.KeyView``:

* ``blockwise`` (every platform, every cache kind): ``softmax.blockwise`` over the cache's key
  blocks (a bounded read: up to the device's furthest query). Plain JAX, so it runs on every
  backend; the engine's cached attention on CPU, and on TPU but for interleaved pages.
* ``cuDNN`` (GPU, every cache kind): ``jax.nn.dot_product_attention(implementation="cudnn")``
  (flash attention) over the whole span it is handed (a paged cache's pages gathered for it
  through the rows' page tables), when cuDNN takes the call (bf16/fp16), else ``blockwise``.
* ``ragged_paged_attention`` (TPU, interleaved pages): the Pallas kernel (``kernels_tpu``).
* ``causal`` (every platform, no cache): ``sequence.causal``.

Shipped kernels where JAX has one that fits; ``blockwise`` and ``causal`` are hand-written
because no shipped kernel takes this cache's queries at a per-row slot offset, mixed decode and
prefill rows, and a validity mask over every backend. Why not the other Pallas TPU kernels:
``pallas.ops.tpu.flash_attention`` aligns its causal mask at key 0, while a cache row here is a
prefix of slots whose queries sit at a per-row offset. ``pallas.ops.tpu.paged_attention`` takes
one query per row (decode only), while an engine call mixes decode rows with prefill chunks; the
unpaged cache (``Rows``, the ragged batch) stays on ``blockwise``, which bounds the memory the
same way on every backend but does not fuse as well.

Why a paged cache on GPU is read by cuDNN over gathered pages, not ``pallas.ops.gpu.
paged_attention`` / ``decode_attention``: those take one query per row (decode only) over
heads-major pages of one layer (``[KVH, pages, page, hd]``), so the engine's ``[L, P, page, K,
hd]`` pages would be relaid out every layer (on TPU the same relayout cost 9.9x the live keys and
values against blockwise's 1.9x, benchmarks/RESULTS.md); and a deviceless H100 compile cannot
show a gain: at a paper-config device's decode shapes (120 rows, 7 query heads over 1 KV head,
16,384 slots) ``decode_attention.gqa`` compiles but the compiled program has no
``cost_analysis()``, and ``paged_attention`` at its default blocks (128-token pages) asks 561 KB
of the 232 KB of shared memory. The GPU configs (``configs/paper.py``'s H100/H200 targets) run
unpaged.
"""
from __future__ import annotations

import jax

from jaxes.models import kernels_tpu
from jaxes.models.attention import dispatch, sequence, softmax
from jaxes.models.attention.keys import KeyView


def blockwise_cached(q: jax.Array, keys: KeyView) -> jax.Array:
  """``blockwise`` over a cache (a bounded read: up to this device's furthest query only)."""
  return softmax.blockwise(q, keys.read, keys.visible, keys.span, keys.key_block(),
                           keys_needed=keys.keys_needed())


def cudnn_cached(q: jax.Array, keys: KeyView) -> jax.Array:
  """cuDNN over the whole span; where cuDNN refuses the call (or is not installed),
  ``blockwise``."""
  k, v = keys.read(0, keys.span)
  out = softmax.cudnn(q, k, v, keys.visible(0, keys.span))
  return blockwise_cached(q, keys) if out is None else out


def ragged_paged(q: jax.Array, keys: KeyView) -> jax.Array:
  """``kernels_tpu.paged_attention`` over interleaved pages: it reads each row's pages up to its
  last token, so ``span`` and ``bounded`` change nothing; it takes a row's valid slots to be a
  prefix, as the engine keeps them."""
  stored = keys.stored
  return kernels_tpu.paged_attention(q, stored.pages, stored.layer, keys.addressing.q_slots,
                                     stored.table, stored.dtype)


BLOCKWISE = dispatch.Implementation("blockwise", blockwise_cached)
CUDNN = dispatch.Implementation("cuDNN", cudnn_cached, reads_whole_span=True)
RAGGED_PAGED = dispatch.Implementation("ragged_paged_attention", ragged_paged)
CAUSAL = dispatch.Implementation("causal", sequence.causal_sequence)
dispatch.register("*", "none", CAUSAL)
dispatch.register("*", "dense", BLOCKWISE)
dispatch.register("*", "paged", BLOCKWISE)
dispatch.register("*", "paged_interleaved", BLOCKWISE)
dispatch.register("gpu", "dense", CUDNN)
dispatch.register("gpu", "paged", CUDNN)
dispatch.register("gpu", "paged_interleaved", CUDNN)
dispatch.register("tpu", "paged_interleaved", RAGGED_PAGED)

"""Grouped-query attention that never holds a ``[.., queries, keys]`` float32 score tensor for the
whole key range, and the one interface through which the model reaches its KV cache.

The package by job:

* ``softmax``: the math (``dense``, the reference; ``blockwise``, an online softmax over key
  blocks; ``cudnn``, flash attention where cuDNN takes the call) and ``KV_BLOCK``.
* ``sequence``: causal attention of a whole sequence, no cache (``causal``, ``attend_sequence``).
* ``keys``: what an implementation reads: a call's ``Addressing`` (one pytree: each token's slot,
  the slots it sees, where its keys go, how far keys are read) and a layer's ``KeyView``.
* ``rows`` and ``pages``: the cache access classes (``CacheAccess``: ``Dense``, ``Rows``,
  ``Pages``), each with ``write(cache, layer, k, v)`` and ``attend(q, cache, layer)``.
* ``cache``: ``LayerCache`` (buffers, access, addressing, implementation), built once a call by
  ``layer_cache``, which asks the table for the implementation.
* ``dispatch``: the table ``(platform, cache kind) -> Implementation`` and what follows from it
  (the engine's attention spans and paged layout, the preflight's name for the path);
  ``implementations``: its built-in entries.

The platform is the one the program is compiled for (``target_platform``: the mesh's devices),
not the process's default backend, so a deviceless compile for a GPU or TPU target from a CPU
machine (the preflight) builds the program the real run would.
"""
from jaxes.models.attention.cache import LayerCache, as_bits, layer_cache
from jaxes.models.attention.dispatch import (attention_spans, describe, interleave_pages,
                                             interleaved, target_platform)
from jaxes.models.attention.implementations import BLOCKWISE, CAUSAL, CUDNN, RAGGED_PAGED
from jaxes.models.attention.keys import BOUNDED_KV_BLOCK, Addressing, KeyView
from jaxes.models.attention.pages import Pages
from jaxes.models.attention.rows import CacheAccess, Dense, Rows
from jaxes.models.attention.sequence import attend_sequence, causal
from jaxes.models.attention.softmax import block_size, blockwise, dense

__all__ = ["Addressing", "BLOCKWISE", "BOUNDED_KV_BLOCK", "CAUSAL", "CUDNN", "CacheAccess",
           "Dense", "KeyView", "LayerCache", "Pages", "RAGGED_PAGED", "Rows", "as_bits",
           "attend_sequence", "attention_spans", "block_size", "blockwise", "causal", "dense",
           "describe", "interleave_pages", "interleaved", "layer_cache", "target_platform"]

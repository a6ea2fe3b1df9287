"""The KV cache as one decoder layer sees it: ``LayerCache``, the buffers with the call's
``Addressing``, the access that reaches them and the implementation that reads them, chosen
once (``layer_cache``)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxes.models.attention import dispatch
from jaxes.models.attention.keys import Addressing


def as_bits(x: jax.Array) -> jax.Array:
  """``x``'s raw bits as unsigned ints of its width (a free bitcast)."""
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "access", "addressing"], meta_fields=["dtype", "impl"])
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """The KV cache as one decoder layer sees it, a named pytree. ``k, v``: the whole cache's
  buffers (every layer; raw bits of ``dtype``, or interleaved pages holding values; ``dtype``
  None: values), which a layer scan carries and each layer writes into in place. ``access``
  (``rows.CacheAccess``): how the batch reaches the buffers; ``addressing``: where the call's
  tokens are. Static: ``dtype``, ``impl`` (the ``dispatch.Implementation`` that reads them)."""
  k: jax.Array
  v: jax.Array
  access: Any
  addressing: Addressing
  dtype: Any
  impl: dispatch.Implementation

  def write(self, layer: jax.Array, k: jax.Array, v: jax.Array) -> "LayerCache":
    """This cache with the new keys and values ``[n, T, K, hd]`` (compute dtype) written at
    layer ``layer``: only the new tokens are converted to the cache's bits."""
    cache_k, cache_v = self.access.write(self, layer, as_bits(k.astype(self.dtype)),
                                         as_bits(v.astype(self.dtype)))
    return dataclasses.replace(self, k=cache_k, v=cache_v)

  def attend(self, q: jax.Array, layer: jax.Array) -> jax.Array:
    """Attention of ``q [n, T, K, G, hd]`` to layer ``layer`` of this cache."""
    return self.access.attend(q, self, layer)


def layer_cache(k: jax.Array, v: jax.Array, access, addressing: Addressing,
                dtype=None) -> LayerCache:
  """The ``LayerCache`` of buffers ``k, v`` reached through ``access``, with the implementation
  the dispatch table names for the access's platform and cache kind, chosen here once for every
  layer, and a bounded read's key block for that platform (``Addressing.for_platform``)."""
  platform = access.platform
  return LayerCache(k, v, access, addressing.for_platform(platform), dtype,
                    dispatch.choose(platform, access.cache_kind(v)))

"""Keys for ES noise: one per (run, version, antithetic pair, parameter leaf, scanned layer).

``member_key = fold_in(fold_in(run_key, version), pair_id)`` with ``pair_id = member // 2`` when
sampling is antithetic (members ``2j`` and ``2j+1`` share a key and differ in sign). A leaf folds in
a stable id hashed from its *path*, so equal-shaped tensors get independent noise and adding a
parameter leaves every other leaf's noise unchanged; a scanned layer folds in its layer index.
Every function here works on Python ints and on traced int32 values alike.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp


def param_name(path) -> str:
  """'/'-joined name of a pytree key path, as in the model's pure state dict.

  ``nnx.State`` leaves end in a ``.value`` attribute of their ``Variable``; that suffix is not part
  of the parameter's name.
  """
  parts = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      parts.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.SequenceKey):
      parts.append(str(entry.idx))
    elif isinstance(entry, jax.tree_util.GetAttrKey):
      parts.append(entry.name)
    elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
      parts.append(str(entry.key))
    else:
      parts.append(str(entry))
  if len(parts) > 1 and parts[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
    parts.pop()
  return "/".join(parts)


def leaf_id(name: str) -> int:
  """Stable 31-bit id of a parameter name (CRC-32), independent of its position in the tree."""
  return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def pair_id(member, antithetic: bool):
  return member // 2 if antithetic else member


def member_sign(member, antithetic: bool):
  """+1 for even members, -1 for odd ones when antithetic; always +1 otherwise (float32)."""
  if not antithetic:
    return jnp.ones_like(jnp.asarray(member), dtype=jnp.float32)
  return 1.0 - 2.0 * (jnp.asarray(member) % 2).astype(jnp.float32)


def member_key(run_key: jax.Array, version, member, antithetic: bool) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(run_key, version), pair_id(member, antithetic))


def leaf_key(mkey: jax.Array, name: str, layer=None) -> jax.Array:
  key = jax.random.fold_in(mkey, leaf_id(name))
  return key if layer is None else jax.random.fold_in(key, layer)

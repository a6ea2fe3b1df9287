"""Where an engine's arrays live: rows over the mesh's ``data`` axis, the rest replicated.

The engine and its policy bank (``jaxes.rollout.policy_bank``) hand the device host arrays of two
kinds: per-slot (or per-token, per-sample) arrays split over ``data`` with the cache's rows, and
small arrays every device holds whole. ``Placement`` places both the way the programs are lowered,
on one process or on a multi-process mesh (each process filling its own shards).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Placement:
  """``mesh``: the engine's (data, fsdp, tensor) mesh; ``num_slots``: its cache rows, split over
  ``data``; ``param_shardings``: the rule table's shardings of the model's parameters;
  ``abstract``: nothing is allocated (shapes and shardings only)."""
  mesh: Mesh
  num_slots: int
  param_shardings: object
  abstract: bool = False

  @property
  def shards(self) -> int:
    return self.mesh.shape["data"]

  @property
  def rows(self) -> NamedSharding:
    """Per-slot arrays ``[B, ...]`` (and per-token, per-sample ones): over ``data``."""
    return NamedSharding(self.mesh, PartitionSpec("data"))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def readable(self) -> frozenset:
    """The slots whose sampled tokens this process reads: those of its devices' data shards (all
    on one process). Another process's rows are known here by their counts and last tokens."""
    if self.abstract or self.rows.is_fully_addressable:
      return frozenset(range(self.num_slots))
    return frozenset(i for index in self.rows.addressable_devices_indices_map(
        (self.num_slots,)).values() for i in range(self.num_slots)[index[0]])

  def by_rows(self, *arrays: np.ndarray) -> tuple:
    """Host arrays as arguments of the jitted programs, split over ``data`` as ``programs()``
    lowers them (numpy arguments trace to programs of another text, which the persistent cache
    keys apart); on a multi-process mesh global arrays, each process filling its own shards from
    its copy (identical on every process: the host state is)."""
    return _place(arrays, self.rows)

  def everywhere(self, *arrays: np.ndarray) -> tuple:
    """Host arrays as replicated arguments (``by_rows``'s counterpart for arrays without rows)."""
    return _place(arrays, self.replicated)

  def put(self, x: np.ndarray, where: NamedSharding) -> jax.Array:
    """One host array in ``where`` (a sharding of this mesh), as ``by_rows`` places."""
    return _place((x,), where)[0]

  def own_rows(self, x: jax.Array, fill) -> np.ndarray:
    """``x`` (rows over ``data``) on the host: whole on one process; on several, the rows of this
    process's shards only (the rest ``fill``), so no process reads, or waits for, another's."""
    if x.is_fully_addressable:
      return np.asarray(x)
    out, seen = np.full(x.shape, fill, x.dtype), set()
    for shard in x.addressable_shards:
      rows = shard.index[0].indices(x.shape[0])
      if rows not in seen:   # a shard's copies on this process's other devices (tensor, fsdp)
        seen.add(rows)
        out[shard.index] = np.asarray(shard.data)
    return out


def _place(arrays, where: NamedSharding) -> tuple:
  """Copies are placed: on CPU ``device_put`` may alias a numpy array's memory, and the scheduler
  writes its arrays in place while a dispatched call may not have read them yet."""
  if where.is_fully_addressable:   # placed as programs() lowers them: one cache entry
    return tuple(jax.device_put(tuple(np.array(x) for x in arrays), where))
  return tuple(jax.make_array_from_callback(x.shape, where, lambda index, x=np.array(x): x[index])
               for x in arrays)

"""What a device holds and moves: the sizing numbers the preflight predicts with and ``jaxes.measure``
checks them by, decided here once.

* ``bytes_per_device``: one device's bytes of a tree of sharded arrays or ShapeDtypeStructs (the
  preflight's resident state; measure's weights and KV per decode step). ``jaxes.sharding``'s
  ``bytes_per_device`` counts a parameter tree from its logical axes instead, before placement.
* ``host_memory_per_device`` / ``device_memory``: the memory a device may use (``cpu:N``: the
  host's RAM split N ways; a device with memory statistics: its ``bytes_limit``).
* ``peak_bytes_in_use``: the measured high-water mark of the devices.
* ``PEAK_HBM`` / ``peak_bandwidth`` and ``program_bytes``: the roofline's peak and the compiler's
  own count of the bytes a program moves.
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

# Peak HBM bandwidth per chip, bytes/s, by the start of ``device_kind`` as JAX reports it (first
# match wins; more specific names first). Sources:
# * NVIDIA H100 SXM5 80GB: 3.35 TB/s, NVIDIA H100 Tensor Core GPU datasheet (the figure XLA's
#   own h100_sxm.txtpb spec carries, jaxes.gpu_targets); H100 PCIe 2.0 TB/s, same datasheet.
# * NVIDIA H200 141GB: 4.8 TB/s, NVIDIA H200 Tensor Core GPU datasheet.
# * NVIDIA A100 SXM4 80GB: 2,039 GB/s; A100 40GB: 1,555 GB/s; NVIDIA A100 datasheet.
# * TPU v4: 1,200 GBps; v5e: 819 GBps; v5p: 2,765 GBps; v6e (Trillium): 1,638 GBps; Google Cloud
#   TPU system-architecture pages, docs.cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}.
PEAK_HBM = (
  ("NVIDIA H100 PCIe", 2.0e12, "NVIDIA H100 datasheet (PCIe)"),
  ("NVIDIA H100", 3.35e12, "NVIDIA H100 datasheet (SXM5)"),
  ("NVIDIA H200", 4.8e12, "NVIDIA H200 datasheet"),
  ("NVIDIA A100-SXM4-40GB", 1.555e12, "NVIDIA A100 datasheet (40GB)"),
  ("NVIDIA A100-SXM4-80GB", 2.039e12, "NVIDIA A100 datasheet (SXM4 80GB)"),
  ("TPU v4", 1.2e12, "Cloud TPU v4 system architecture"),
  ("TPU v5 lite", 8.19e11, "Cloud TPU v5e system architecture"),
  ("TPU v5e", 8.19e11, "Cloud TPU v5e system architecture"),
  ("TPU v5p", 2.765e12, "Cloud TPU v5p system architecture"),
  ("TPU v5", 2.765e12, "Cloud TPU v5p system architecture"),
  ("TPU v6 lite", 1.638e12, "Cloud TPU v6e system architecture"),
  ("TPU v6e", 1.638e12, "Cloud TPU v6e system architecture"),
)


def bytes_per_device(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs or arrays (the largest
  shard: uneven shardings put more on some devices)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def host_memory_per_device(num_devices: int) -> float:
  """The host's RAM split over ``num_devices`` host devices."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / num_devices


def device_memory(devices) -> float:
  """Bytes a device may use: its ``memory_stats()`` ``bytes_limit``, or on a backend without
  memory statistics (CPU) the host's RAM split over the devices."""
  stats = devices[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return float(stats["bytes_limit"])
  return host_memory_per_device(len(devices))


def peak_bytes_in_use(devices) -> tuple[int, str]:
  """(bytes, how): the largest ``peak_bytes_in_use`` of the devices, or on a backend without
  memory statistics (CPU) the largest sum of live arrays' shards on one device."""
  stats = [d.memory_stats() for d in devices]
  if all(s and "peak_bytes_in_use" in s for s in stats):
    return max(int(s["peak_bytes_in_use"]) for s in stats), "memory_stats peak_bytes_in_use"
  per_device = {d: 0 for d in devices}
  for array in jax.live_arrays():
    for shard in array.addressable_shards:
      if shard.device in per_device:
        per_device[shard.device] += shard.data.nbytes
  return max(per_device.values()), "live arrays (no memory_stats on this backend: temporaries unseen)"


def peak_bandwidth(device_kind: str) -> tuple[float | None, str]:
  """(peak HBM bytes/s, its source) for a device kind, or (None, why there is none)."""
  for prefix, bandwidth, source in PEAK_HBM:
    if device_kind.startswith(prefix):
      return bandwidth, source
  if device_kind.lower() == "cpu":
    return None, "CPU: no HBM peak"
  return None, f"no known HBM peak for {device_kind!r} (add it to jaxes.sizing.PEAK_HBM)"


def program_bytes(compiled) -> float | None:
  """The compiler's cost analysis of a compiled program: bytes it accesses (per device), or None
  where the backend gives none (the GPU compiler without a GPU, jaxes.gpu_targets, has no cost
  analysis; a GPU with one has). Loops count their body once."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 -- "UNIMPLEMENTED" on compile-only clients: no number, not an error
    return None
  if isinstance(analysis, (list, tuple)):   # older JAX: one dict per computation
    analysis = analysis[0] if analysis else None
  if not analysis or "bytes accessed" not in analysis:
    return None
  return float(analysis["bytes accessed"])

"""The sizing numbers the preflight predicts with and ``jaxes.measure`` checks them by: one device's
bytes of a sharded tree (placed or abstract, the same count), the devices' memory and measured
peak on this CPU, the peak-bandwidth table against the device kinds the GPU and TPU compilers
report for their deviceless devices, and the compiler's cost analysis read from a program compiled
for a v5p."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxes import gpu_targets, sizing


def test_a_devices_bytes_count_its_shard_of_each_leaf_placed_or_abstract():
  devices = jax.devices()[:8]
  mesh = Mesh(np.array(devices), ("data",))
  split, whole = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
  n = len(devices)
  tree = {"rows": jax.device_put(jnp.zeros((2 * n, 4), jnp.float32), split),
          "gain": jax.device_put(jnp.zeros((3,), jnp.bfloat16), whole)}
  assert sizing.bytes_per_device(tree) == 2 * 4 * 4 + 3 * 2
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
  assert sizing.bytes_per_device(abstract) == sizing.bytes_per_device(tree)
  # Each device holds exactly that much of the placed tree.
  held = {d: 0 for d in devices}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      held[shard.device] += shard.data.nbytes
  assert set(held.values()) == {sizing.bytes_per_device(tree)}


def test_on_cpu_memory_is_the_hosts_split_and_the_peak_counts_live_arrays():
  devices = jax.devices()
  assert sizing.device_memory(devices) == sizing.host_memory_per_device(len(devices)) > 0
  kept = jax.device_put(jnp.ones((1024,), jnp.float32), devices[0])
  peak, how = sizing.peak_bytes_in_use(devices)
  assert peak >= kept.nbytes and how.startswith("live arrays")


def _bytes_of_a_matmul(devices) -> float:
  """The compiler's bytes for a [256, 512] @ [512, 512] bfloat16 matmul on ``devices[0]``."""
  mesh = Mesh(np.array(devices[:1]), ("data",))
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
  return sizing.program_bytes(jax.jit(lambda x, w: x @ w).lower(spec((256, 512)), spec((512, 512))).compile())


@pytest.mark.skipif(not gpu_targets.plugin_installed(),
                    reason="the CUDA plugin is not installed (pip install -e '.[gpu-aot]')")
def test_an_h100s_kind_has_its_peak():
  devices = gpu_targets.devices("1xH100")
  bandwidth, source = sizing.peak_bandwidth(devices[0].device_kind)
  assert bandwidth == 3.35e12 and "H100" in source
  # The compile-only GPU client has no cost analysis: the report's compiler bytes are None there
  # (a GPU's own client has them); the roofline itself counts weights and KV from the arrays.
  assert _bytes_of_a_matmul(devices) is None


def test_a_v5ps_kind_has_its_peak_and_its_compiler_counts_bytes(monkeypatch):
  pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[tpu]')")
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock
  from jax.experimental import topologies
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  assert sizing.peak_bandwidth(devices[0].device_kind)[0] == 2.765e12
  moved = 2 * (256 * 512 + 512 * 512 + 256 * 512)
  assert moved <= _bytes_of_a_matmul(devices) < 4 * moved


def test_the_table_names_each_kind_and_no_peak_is_invented():
  assert sizing.peak_bandwidth("NVIDIA H200")[0] == 4.8e12
  assert sizing.peak_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
  assert sizing.peak_bandwidth("TPU v5 lite")[0] == 8.19e11
  assert sizing.peak_bandwidth("TPU v6 lite")[0] == 1.638e12
  assert sizing.peak_bandwidth("cpu") == (None, "CPU: no HBM peak")
  bandwidth, reason = sizing.peak_bandwidth("NVIDIA B200")
  assert bandwidth is None and "PEAK_HBM" in reason

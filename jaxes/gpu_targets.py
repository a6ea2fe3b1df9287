"""GPU targets for deviceless ahead-of-time compiles: the real XLA GPU compiler, no GPU needed.

``devices("8xH100")`` describes 8 H100s through the CUDA plugin's topology
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology="1x1x8")``,
the path JAX's own deviceless AOT test uses), or returns ``None`` when the plugin is not installed
(``pip install -e '.[gpu-aot]'``). The process must run with ``JAX_PLATFORMS=cpu``: otherwise the
plugin initialises CUDA at import and fails on a machine without a GPU.

Each target config is a ``GpuTargetConfigProto`` in text form (XLA's stream_executor
``device_description.proto``). Each target needs its own: the compiler's rematerialisation works
against ``device_memory_size``. Sources of the numbers:
* H100 SXM 80GB: XLA's ``xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb`` (what the driver reports:
  132 SMs, 50 MiB L2, 3.35 TB/s, 84978434048 bytes), NVIDIA's H100 datasheet for the same figures.
* H200 141GB: NVIDIA's H200 datasheet (141 GB HBM3e at 4.8 TB/s, the H100's SM count and L2); the
  driver-reported memory, 150.75 GB, as measured on an H200 and quoted in issue 32.
``dnn_version_info`` (cuDNN 9) is required for the compiler to emit cuDNN attention fusions.
"""
from __future__ import annotations

import dataclasses

_CONFIG = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 3
}}
device_description_str: "{description}"
"""


@dataclasses.dataclass(frozen=True)
class GpuChip:
  description: str
  memory: int        # bytes per device, as the driver reports them (what the compiler is told)
  bandwidth: int     # bytes/s
  nominal: float     # the vendor's HBM in decimal GB: what the preflight's headroom is taken of

  def target_config(self, memory: int | None = None) -> str:
    """The compiler's target; ``memory`` instead of the chip's (rematerialisation works to it)."""
    return _CONFIG.format(bandwidth=self.bandwidth, memory=memory or self.memory,
                          description=self.description)


CHIPS = {
  "H100": GpuChip("NVIDIA H100 80GB HBM3", 84_978_434_048, 3_352_320_000_000, 80e9),
  "H200": GpuChip("NVIDIA H200", 150_750_000_000, 4_800_000_000_000, 141e9),
}


def parse(name: str) -> tuple[GpuChip, int] | None:
  """``"8xH100"`` -> (the H100, 8); ``None`` for a name that is not ``NxCHIP``."""
  count, sep, chip = name.partition("x")
  if not sep or not count.isdigit() or int(count) < 1 or chip not in CHIPS:
    return None
  return CHIPS[chip], int(count)


def plugin_installed() -> bool:
  """Whether the CUDA plugin (the ``gpu-aot`` extra) is installed; False, never an error, without
  it (``find_spec`` raises where no ``jax_plugins`` namespace package is installed at all)."""
  import importlib.util
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    return False


def cudnn_installed() -> bool:
  """Whether cuDNN's library is there for the CUDA plugin to load (the ``nvidia-cudnn-cu12`` wheel
  of the plugin's ``[with-cuda]`` extra). Without it cuDNN attention cannot be traced, even
  deviceless ("cuDNN not found"), and the engine's attention falls back to blockwise
  (``jaxes.models.attention``): a GPU compile then sizes the attention a GPU run with cuDNN does
  not use."""
  import importlib.util
  try:
    return importlib.util.find_spec("nvidia.cudnn") is not None
  except ModuleNotFoundError:   # no ``nvidia`` namespace package at all
    return False


CUDNN_HINT = ("pip install 'jax-cuda12-plugin[with-cuda]==<jax version>' (all CUDA wheels, ~5.5 GB; "
              "the nvidia-cudnn-cu12, -cublas-, -cuda-runtime- and -cuda-nvrtc-cu12 wheels suffice, 2.2 GB)")


def devices(name: str, memory: int | None = None) -> list | None:
  """Abstract devices of an ``NxCHIP`` target for the real GPU compiler, ``None`` without the plugin.
  Up to 8 GPUs per host (the HGX boards); more are hosts of 8. ``memory``: bytes per device the
  compiler is told instead of the chip's."""
  chip, n = parse(name)
  if not plugin_installed():
    return None
  from jax.experimental import topologies
  per_host = min(n, 8)
  if n % per_host:
    raise SystemExit(f"preflight: {name}: a multi-host GPU target is a multiple of 8 GPUs")
  topo = topologies.get_topology_desc(platform="cuda", target_config=chip.target_config(memory),
                                      topology=f"1x{n // per_host}x{per_host}")
  return list(topo.devices)

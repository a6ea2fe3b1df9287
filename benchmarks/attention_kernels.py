"""Bytes a decode step's paged attention moves on a TPU, per device, from the TPU compiler
(deviceless, through libtpu): the portable blockwise path against ``ragged_paged_attention``,
over the ideal (this device's live keys and values; for a whole step, plus its weights).

  python benchmarks/attention_kernels.py [--topology=v5p-64] [--page=64]

Qwen2.5-7B shapes, bfloat16, one decode token for each of the mesh's rows (240 rows over
data=8 x tensor=4 on v5p-64: 30 rows and 1 KV head per device), row lengths spread from 512 to
8,704 tokens of a 16,384-slot row. Three programs of one layer's attention, each compiled for the
topology; ``compiled.cost_analysis()["bytes accessed"]`` is the per-device figure:

* ``blockwise``: ``attention.Pages.attend`` on the portable path (what TPU ran before). It reads
  512-key blocks up to the device's furthest token in a loop whose trip count is traced, and the
  compiler's cost model counts a loop body once: the program compiled here is one block
  (span 512) and its bytes are multiplied by the blocks a step reads (ceil(longest / 512)). The
  cost model charges each block's gather (fused into the dot that reads it) with the whole page
  pool, so beside it is what the gathers must read: every row, every block up to the longest.
* ``kernel, layout built at the call``: split pages turned into the kernel's interleaved layout
  (``kernels_tpu.combined_pages``) inside the program, then the kernel: relayout copies of this
  device's page pool every layer, which the compiler counts. Why split pages stay on blockwise.
* ``kernel, interleaved cache``: ``Pages.attend`` on TPU over an engine cache kept in the kernel's
  layout (``PagedKVCache.init(interleaved=True)``), all 28 layers in one array.

The compiler cannot see a Pallas kernel's own DMAs (its total leaves the custom call's page-pool
operand out), so both kernel rows add what the kernel copies: each row's pages up to its length,
ceil(len / page) pages (``kernel.py``'s ``create_kv_async_copy_descriptors``). Printed: a table
and one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: no TPU to share

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxes.models import attention, kernels_tpu, qwen2  # noqa: E402

TOPOLOGIES = {"v5p-8": ("v5p:2x2x1", 1, 4), "v5p-64": ("v5p:2x4x4", 8, 4)}  # name, data, tensor
ROWS, MAX_LEN, BLOCK = 240, 16384, 512


def row_lengths(rows: int) -> np.ndarray:
  """Each device's rows spread evenly from 512 to 8,704 tokens (the same on every device)."""
  return 512 + (np.arange(rows) * 8192) // max(rows - 1, 1)


def weight_bytes_per_device(cfg: qwen2.Qwen2Config, tensor: int) -> float:
  """The model's parameters in its dtype, split over ``tensor`` (what a decode step reads)."""
  shapes = nnx.state(nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))))
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  return count * jnp.dtype(cfg.dtype).itemsize / tensor


def compiled_bytes(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis()["bytes accessed"])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5p-64", choices=sorted(TOPOLOGIES))
  parser.add_argument("--page", type=int, default=64)
  args = parser.parse_args(argv)
  from jax.experimental import topologies
  spec, data, tensor = TOPOLOGIES[args.topology]
  devices = topologies.get_topology_desc(spec, "tpu").devices
  mesh = Mesh(np.array(devices).reshape(data, tensor), ("data", "tensor"))
  cfg = qwen2.Qwen2Config.preset("qwen2.5-7b", dtype="bfloat16")
  K, G, hd, page = cfg.num_kv_heads, cfg.num_groups, cfg.head_size, args.page
  n_local, k_local, item = ROWS // data, K // tensor, 2
  lengths = row_lengths(n_local)
  live_pages = int(np.sum(-(-lengths // page)))
  pool = int(live_pages * 1.1)            # a pool sized to the tokens in use, 10% spare

  def sds(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  cache_spec = P(None, "data", None, "tensor", None)
  split = sds((1, pool * data, page, K, hd), jnp.uint16, cache_spec)   # one layer, raw bf16 bits
  # the engine's interleaved cache, every layer, values (reading one layer must not copy it)
  mixed = sds((cfg.num_layers, pool * data, page, 2 * K, hd), jnp.bfloat16, cache_spec)
  empty = sds((cfg.num_layers, pool * data, page, 0, hd), jnp.bfloat16, cache_spec)
  q = sds((ROWS, 1, K, G, hd), jnp.bfloat16, P("data", None, "tensor"))
  layer = sds((), jnp.int32, P())
  q_slots = sds((ROWS, 1), jnp.int32, P("data"))

  def rows(width):
    return (sds((ROWS, width), bool, P("data")), q_slots,
            sds((ROWS, width // page), jnp.int32, P("data")))

  def attend(span, convert=False):
    def fn(q, pk, pv, layer, valid, q_slots, table):
      if convert:   # the kernel's layout built from split pages at the call
        pk = kernels_tpu.combined_pages(pk, pv)
        pv = jnp.zeros(pk.shape[:3] + (0, hd), pk.dtype)
      return attention.Pages(table, mesh, "data", "tensor").attend(
          q, pk, pv, layer, valid, q_slots, span, jnp.bfloat16, block=BLOCK, bounded=False)
    return fn

  one_block = compiled_bytes(attend(BLOCK), q, split, split, layer, *rows(BLOCK))
  blocks = -(-int(lengths.max()) // BLOCK)
  at_call = compiled_bytes(attend(MAX_LEN, convert=True), q, split, split, layer, *rows(MAX_LEN))
  native = compiled_bytes(attend(MAX_LEN), q, mixed, empty, layer, *rows(MAX_LEN))
  pool_bytes = pool * page * 2 * k_local * hd * item        # this device's pool of one layer
  kernel_reads = live_pages * page * 2 * k_local * hd * item  # the kernel's DMAs, this device
  ideal = float(np.sum(lengths)) * 2 * k_local * hd * item
  gathered = n_local * blocks * BLOCK * 2 * k_local * hd * item
  per_layer = {
    "blockwise (cost model)": one_block * blocks,
    "blockwise (gathers)": gathered,
    "kernel, layout built at the call": at_call + kernel_reads,
    "kernel, interleaved cache": native + kernel_reads,
  }
  weights = weight_bytes_per_device(cfg, tensor)
  L = cfg.num_layers
  result = {
    "bench": "attention_kernels", "topology": args.topology, "page": page,
    "rows_per_device": n_local, "kv_heads_per_device": k_local,
    "ideal_attention_bytes_per_layer": ideal,
    "compiled_bytes": {"blockwise_one_block": one_block, "blocks_read": blocks,
                       "kernel_layout_at_call": at_call, "kernel_interleaved_cache": native,
                       "pool_bytes_per_layer": pool_bytes, "kernel_dma_bytes": kernel_reads,
                       "blockwise_gathers": gathered},
    "attention_over_ideal": {k: v / ideal for k, v in per_layer.items()},
    "step_over_ideal": {k: (weights + L * v) / (weights + L * ideal) for k, v in per_layer.items()},
    "weight_bytes_per_device": weights,
    "machine": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "jax": jax.__version__,
  }
  print(f"{args.topology}, page {page}: {n_local} rows x {k_local} KV head per device, lengths "
        f"{lengths.min()}-{lengths.max()}; ideal attention {ideal / 2**20:.1f} MiB/layer, "
        f"weights {weights / 2**30:.2f} GiB", file=sys.stderr)
  print(f"{'path':<34}{'MiB/layer':>11}{'/ideal':>9}{'step/ideal':>12}", file=sys.stderr)
  for k, v in per_layer.items():
    print(f"{k:<34}{v / 2**20:>11.1f}{v / ideal:>9.2f}{result['step_over_ideal'][k]:>12.3f}",
          file=sys.stderr)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()

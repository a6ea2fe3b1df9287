"""Bytes a decode step's paged attention moves on a TPU, per device, from the TPU compiler
(deviceless, through libtpu): the portable blockwise path against ``ragged_paged_attention``,
over the ideal (this device's live keys and values; for a whole step, plus its weights).

  python benchmarks/attention_kernels.py [--topology=v5p-64] [--page=128]

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
  layout (``PagedKVCache.init(interleaved=True)``), all 28 layers in one array: what a paged
  engine runs on TPU (``configs/paper.py``'s v5p targets).
* ``blockwise, unpaged cache``: ``attention.Rows.attend`` over the dense ``[L, rows, 16384, K,
  hd]`` cache (what the paper config ran on TPU before it was paged), measured as the paged
  blockwise row: one block compiled; its gathers read what the paged ones do.

The largest token bucket (a prefill chunk of 512 tokens at slot 4,096 beside the other 29 rows'
decode tokens, ``Engine.buckets``' 542 tokens per device, one token per batch row as the
engine's flat buffer holds them) is counted from the kernel's copy rule (each query block of
``QUERIES_PER_BLOCK`` re-reads every sequence in it up to its length): the kernel's sequences as
``kernels_tpu.ragged_runs`` makes them (the chunk one run) against one sequence per token, and
blockwise's per-token key-block gathers, over the call's live keys and values read once.

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


CHUNK, CHUNK_AT = 512, 4096   # the largest bucket's prefill chunk and its first slot


def kernel_pages_read(kv_lens, cu_q_lens, num_seqs: int, page: int) -> int:
  """Pages ``ragged_paged_attention`` copies for a batch (its ``create_kv_async_copy_descriptors``
  loop): every query block of ``QUERIES_PER_BLOCK`` reads each sequence it holds up to the
  sequence's length, ceil(len / page) pages."""
  qb, total = kernels_tpu.QUERIES_PER_BLOCK, 0
  for s in range(num_seqs):
    blocks = (int(cu_q_lens[s + 1]) - 1) // qb - int(cu_q_lens[s]) // qb + 1
    total += blocks * -(-int(kv_lens[s]) // page)
  return total


def prefill_bucket(lengths: np.ndarray, page: int, token_bytes: int) -> dict[str, float]:
  """The largest bucket on one device: row 0 feeds a ``CHUNK``-token chunk at slots ``CHUNK_AT
  ...``, the other rows a decode token each at their length, one token per batch row in the
  engine's order (decoding rows first); pages of a row are its own. Attention bytes over the
  call's live KV, each row's keys and values read once."""
  decode = lengths[1:]
  slots = np.concatenate([decode, CHUNK_AT + np.arange(CHUNK)])
  owner = np.concatenate([np.arange(1, len(lengths)), np.zeros(CHUNK, int)])
  width = MAX_LEN // page
  table = (owner[:, None] * width + np.arange(width)[None, :]).astype(np.int32)
  ideal = (int(np.sum(decode + 1)) + CHUNK_AT + CHUNK) * token_bytes
  runs = jax.jit(kernels_tpu.ragged_runs)(jnp.asarray(slots[:, None], jnp.int32), jnp.asarray(table))
  kv_lens, _, cu, num = (np.asarray(x) for x in runs)
  per_token = kernel_pages_read(slots + 1, np.arange(len(slots) + 1), len(slots), page)
  blocks = -(-int(slots.max() + 1) // BLOCK)
  return {"kernel, runs (ragged_runs)": kernel_pages_read(kv_lens, cu, int(num[0]), page) * page
          * token_bytes / ideal,
          "kernel, a sequence per token": per_token * page * token_bytes / ideal,
          "blockwise (gathers)": len(slots) * blocks * BLOCK * token_bytes / ideal}


def compiled_bytes(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis()["bytes accessed"])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5p-64", choices=sorted(TOPOLOGIES))
  parser.add_argument("--page", type=int, default=128)
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
      return attention.layer_cache(
          pk, pv, attention.Pages(table, mesh, "data", "tensor"),
          attention.Addressing(valid, q_slots, span=span, block=BLOCK), jnp.bfloat16).attend(q, layer)
    return fn

  one_block = compiled_bytes(attend(BLOCK), q, split, split, layer, *rows(BLOCK))
  dense = sds((1, ROWS, BLOCK, K, hd), jnp.uint16, cache_spec)   # one block of the unpaged cache
  index = sds((ROWS,), jnp.int32, P("data"))

  def attend_rows(q, ck, cv, layer, valid, q_slots, index):
    return attention.layer_cache(
        ck, cv, attention.Rows(index, mesh, "data", "tensor"),
        attention.Addressing(valid, q_slots, span=BLOCK, block=BLOCK), jnp.bfloat16).attend(q, layer)
  unpaged_block = compiled_bytes(attend_rows, q, dense, dense, layer, *rows(BLOCK)[:2], index)
  blocks = -(-int(lengths.max()) // BLOCK)
  at_call = compiled_bytes(attend(MAX_LEN, convert=True), q, split, split, layer, *rows(MAX_LEN))
  native = compiled_bytes(attend(MAX_LEN), q, mixed, empty, layer, *rows(MAX_LEN))
  pool_bytes = pool * page * 2 * k_local * hd * item        # this device's pool of one layer
  kernel_reads = live_pages * page * 2 * k_local * hd * item  # the kernel's DMAs, this device
  ideal = float(np.sum(lengths)) * 2 * k_local * hd * item
  gathered = n_local * blocks * BLOCK * 2 * k_local * hd * item
  per_layer = {
    "blockwise, unpaged (cost model)": unpaged_block * blocks,
    "blockwise (cost model)": one_block * blocks,
    "blockwise (gathers)": gathered,
    "kernel, layout built at the call": at_call + kernel_reads,
    "kernel, interleaved cache": native + kernel_reads,
  }
  weights = weight_bytes_per_device(cfg, tensor)
  L = cfg.num_layers
  token_bytes = 2 * k_local * hd * item
  prefill = prefill_bucket(lengths, page, token_bytes)
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
    "prefill_bucket_attention_over_ideal": prefill,
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
  print(f"largest bucket (a 512-token chunk at slot {CHUNK_AT} + {n_local - 1} decode tokens), "
        f"attention bytes / the call's live KV:", file=sys.stderr)
  for k, v in prefill.items():
    print(f"  {k:<32}{v:>9.2f}", file=sys.stderr)
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()

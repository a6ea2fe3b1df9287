"""Per-tick host exchange cost: ``jaxes.distributed.allgather_host`` (two device all-gathers via
``multihost_utils.process_allgather``) beside JAX's coordination-service key-value store (the
alternative that avoids devices), at payload sizes a tick's finished results take.

    launch/local.sh 2 -- python benchmarks/host_exchange.py [--calls 100]

Process 0 prints one JSON line: median milliseconds per exchange for each size and both ways,
and their ratio. The key-value store is reached through JAX's private ``global_state.client``
(not used by jaxes; here only to measure the alternative).
"""
from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import time

from jaxes import distributed

distributed.initialize()

import jax  # noqa: E402  (after initialize)
from jax._src import distributed as jax_distributed  # noqa: E402


def kv_allgather(client, tag: str, obj) -> list:
  me, n = jax.process_index(), jax.process_count()
  client.key_value_set_bytes(f"{tag}/{me}", pickle.dumps(obj, protocol=5))
  out = [pickle.loads(client.blocking_key_value_get_bytes(f"{tag}/{i}", 60_000)) for i in range(n)]
  client.wait_at_barrier(f"{tag}/done", 60_000)   # so keys can be reused/deleted safely
  client.key_value_delete(f"{tag}/{me}")
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=100)
  args = parser.parse_args()
  client = jax_distributed.global_state.client
  me = jax.process_index()
  results = {}
  for size in (100, 1_000, 16_000):   # ~a few results, a full tick of 240 slots, a big tick
    payload = {"process": me, "blob": b"x" * size}
    distributed.allgather_host(payload)          # compile this bucket's gather
    times = {"allgather_host": [], "kv_store": []}
    for i in range(args.calls):
      t = time.perf_counter()
      assert len(distributed.allgather_host(payload)) == jax.process_count()
      times["allgather_host"].append(time.perf_counter() - t)
      t = time.perf_counter()
      assert len(kv_allgather(client, f"bench/{size}/{i}", payload)) == jax.process_count()
      times["kv_store"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    results[size] = {"allgather_host_ms": round(med["allgather_host"], 3),
                     "kv_store_ms": round(med["kv_store"], 3),
                     "ratio_allgather_over_kv": round(med["allgather_host"] / med["kv_store"], 2)}
  if distributed.is_primary():
    print(json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                      "backend": jax.default_backend(), "machine": platform.machine(),
                      "calls": args.calls, "payload_bytes": results}))
  distributed.barrier("bench-done")


if __name__ == "__main__":
  main()

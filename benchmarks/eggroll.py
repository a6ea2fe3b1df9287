"""EGGROLL's throughput microbenchmark alone (``jaxes.es.microbenchmark``), on whatever JAX sees.

  python benchmarks/eggroll.py [--shape 1024,8192,8192] [--dtype bfloat16] [--repeats 20]

One linear layer, a distinct low-rank member per row, no update, through ``jaxes.es``'s noiser vs
the plain matmul; EGGROLL reports 0.91 of the plain throughput. Default shape: EGGROLL's on an
accelerator, scaled down on CPU. ``python -m jaxes.measure`` reports the same number (its
``eggroll`` key) beside the end-to-end cost of ES decoding. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jaxes.es import microbenchmark


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default=None,
                      help="rows (members),in,out; default EGGROLL's (scaled down on CPU)")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()
  shape = (tuple(int(n) for n in args.shape.split(",")) if args.shape else
           microbenchmark.eggroll_shape(jax.devices()[0].platform))
  result = microbenchmark.eggroll(shape, jnp.dtype(args.dtype), args.repeats)
  print(json.dumps({"device_kind": jax.devices()[0].device_kind, **result}))


if __name__ == "__main__":
  main()

"""Model microbenchmarks (CPU-friendly): compile time vs depth under scan, and KV-cache decode
vs recomputing the full prefix. Prints a markdown table of ratios measured side by side.

    JAX_PLATFORMS=cpu python benchmarks/bench_models.py
"""
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxes.models import qwen2


def _model(num_layers, **kw):
  cfg = qwen2.Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=704,
                          num_layers=num_layers, num_heads=8, num_kv_heads=2, **kw)
  return cfg, *nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def compile_seconds(num_layers, B=4, T=64):
  _, graphdef, params = _model(num_layers)
  args = (jnp.zeros((B, T), jnp.int32), jnp.tile(jnp.arange(T), (B, 1)), jnp.ones((B, T), bool))
  start = time.perf_counter()
  jax.jit(qwen2.forward, static_argnums=0).lower(graphdef, params, *args).compile()
  return time.perf_counter() - start


def _best_of(fn, repeats=5):
  fn()  # warm-up / compile
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def decode_vs_recompute(B=8, context=192, steps=16, num_layers=4):
  """Seconds per new token: one cached decode step vs a full forward over the whole prefix."""
  cfg, graphdef, params = _model(num_layers)
  forward = jax.jit(qwen2.forward, static_argnums=0)
  tokens = jax.random.randint(jax.random.key(0), (B, context + steps), 0, cfg.vocab_size)
  positions = jnp.tile(jnp.arange(context + steps), (B, 1))
  cache = qwen2.KVCache.init(cfg, B, context + steps)
  _, cache = forward(graphdef, params, tokens[:, :context], positions[:, :context],
                     jnp.ones((B, context), bool), cache)
  one = jnp.ones((B, 1), bool)
  cached = _best_of(lambda: forward(graphdef, params, tokens[:, context:context + 1],
                                    positions[:, context:context + 1], one, cache)[0])
  full = _best_of(lambda: forward(graphdef, params, tokens[:, :context + 1],
                                  positions[:, :context + 1], jnp.ones((B, context + 1), bool))[0])
  return cached, full


def main():
  c2, c16 = compile_seconds(2), compile_seconds(16)
  cached, full = decode_vs_recompute()
  print("| measurement | value |")
  print("| --- | --- |")
  print(f"| forward compile time, 16 layers / 2 layers (scan over stacked layers) | "
        f"{c16 / c2:.2f}x ({c2:.2f} s vs {c16:.2f} s) |")
  print(f"| cached decode step vs full recompute of a 193-token prefix, B=8, 4 layers | "
        f"{full / cached:.1f}x faster ({cached * 1e3:.2f} ms vs {full * 1e3:.2f} ms per token) |")
  print(f"| cached decode throughput, B=8 (tokens/s) | {8 / cached:.0f} |")


if __name__ == "__main__":
  main()

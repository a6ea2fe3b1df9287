"""Perturb-and-update microbenchmarks of ``jaxes.es`` (CPU or accelerator, whatever JAX sees).

  JAX_PLATFORMS=cpu python benchmarks/perturb_update.py [--dim 2097152] [--population 16]

(a) full-rank update vs N noise generations over theta and vs one read+write pass over theta
    (N antithetic results share N/2 keys, so the update draws N/2 noises); compiled temporary
    memory of the update as N grows (must stay flat);
(b) low-rank update vs the read+write pass;
(c) population decode tokens/s with a KV cache, low-rank perturbed (factors cached per member,
    one member per row) vs unperturbed at the same batch, at two model sizes; for reference also
    low-rank with factors regenerated every step, and full-rank with one weight copy per row;
(d) evosax ``Open_ES`` ask+tell at the same D and N, in the same run.

Prints a table, then one JSON line with every number. Times are the minimum of ``--repeats``
runs after a warm-up (compile) run; ratios compare runs made side by side in this process.
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxes import es
from jaxes.es import keys, noise, update
from jaxes.models import qwen2


def timed_interleaved(calls, repeats: int) -> list[float]:
  """Minimum time of each (fn, args), the variants run in turn (ABCD ABCD ...) so that load
  changes on a shared machine hit all of them alike."""
  for fn, args in calls:
    jax.block_until_ready(fn(*args))
  best = [float("inf")] * len(calls)
  for _ in range(repeats):
    for i, (fn, args) in enumerate(calls):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[i] = min(best[i], time.perf_counter() - t)
  return best


def theta_of_size(dim: int) -> dict:
  """A parameter tree of ~dim float32 values: stacked matrices, an embedding-like matrix, vectors."""
  width = 1024
  rows = max(dim // (2 * width * 4), 1)
  return {"layers": {"w": jnp.zeros((4, rows, width)), "b": jnp.zeros((4, width))},
          "embed": jnp.zeros((4 * rows, width))}


def temp_bytes(jitted, *args) -> int:
  return int(jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes)


def bench_update(dim: int, population: int, repeats: int, with_evosax: bool) -> dict:
  params = theta_of_size(dim)
  d = sum(x.size for x in jax.tree_util.tree_leaves(params))
  cfg_full, cfg_low = noise.NoiseConfig(mode="full"), noise.NoiseConfig(mode="lowrank", rank=1)
  tx = optax.sgd(0.1)
  run_key = jax.random.key(0)
  # N fresh antithetic results, merged into N/2 noise keys exactly as Strategy.update does.
  versions, members, weights = (jnp.asarray(x) for x in update.combine_pairs(
      np.zeros(population, np.int32), np.arange(population, dtype=np.int32),
      np.random.default_rng(0).normal(size=population), antithetic=True))
  weights = weights.astype(jnp.float32)
  count = jnp.int32(population)

  apply_full = jax.jit(functools.partial(update.apply, cfg=cfg_full, tx=tx))
  apply_low = jax.jit(functools.partial(update.apply, cfg=cfg_low, tx=tx))
  specs = noise.plan(params, cfg_full)

  @jax.jit
  def one_noise_generation(run_key):
    mkey = keys.member_key(run_key, 0, 0, True)
    return [noise.full_noise(mkey, s) for s in specs]

  read_write = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 0.5 + 1.0, p))
  args = (params, tx.init(params), run_key, versions, members, weights, count)
  calls = [(apply_full, args), (apply_low, args), (one_noise_generation, (run_key,)),
           (read_write, (params,))]
  if with_evosax:
    calls.append(evosax_ask_tell(d, population))
  times = timed_interleaved(calls, repeats=repeats)
  t_full, t_low, t_noise, t_rw = times[:4]

  memory = {}
  for n in sorted({4, 16, 64, 256, population}):
    memory[n] = temp_bytes(apply_full, params, tx.init(params), run_key, jnp.zeros(n // 2, jnp.int32),
                           2 * jnp.arange(n // 2, dtype=jnp.int32), jnp.ones(n // 2, jnp.float32),
                           jnp.int32(n))
  out = {}
  if with_evosax:
    out = dict(evosax_ask_tell_s=times[4], evosax_temp_bytes=temp_bytes(calls[4][0], *calls[4][1]),
               full_vs_evosax=t_full / times[4])
    out["evosax_vs_full_temp_memory"] = out["evosax_temp_bytes"] / memory[population]
  return out | dict(dim=d, population=population, full_update_s=t_full, lowrank_update_s=t_low,
              noise_generation_s=t_noise, read_write_s=t_rw,
              full_vs_n_noise=t_full / (population * t_noise),
              full_vs_draws=t_full / (len(members) * t_noise), full_vs_read_write=t_full / t_rw,
              lowrank_vs_read_write=t_low / t_rw,
              full_update_temp_bytes={str(n): b for n, b in memory.items()},
              theta_bytes=4 * d)


def evosax_ask_tell(dim: int, population: int):
  """evosax Open_ES ask+tell on a flat vector of ``dim``: a jitted call and its arguments."""
  from evosax.algorithms import Open_ES
  strategy = Open_ES(population_size=population, solution=jnp.zeros(dim), optimizer=optax.sgd(0.1))
  es_params = strategy.default_params
  state = strategy.init(jax.random.key(0), jnp.zeros(dim), es_params)
  fitness = jnp.asarray(np.random.default_rng(0).normal(size=population), jnp.float32)

  @jax.jit
  def ask_tell(key, state, fitness):
    k1, k2 = jax.random.split(key)
    population_x, state = strategy.ask(k1, state, es_params)
    state, _ = strategy.tell(k2, population_x, fitness, state, es_params)
    return state

  return ask_tell, (jax.random.key(1), state, fitness)


def decode_model(size: str):
  if size == "tiny":
    cfg = qwen2.Qwen2Config.preset("tiny")
  else:
    cfg = qwen2.Qwen2Config.preset("tiny-gqa", vocab_size=8192, hidden_size=512,
                                   intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=2)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def bench_decode(size: str, batch: int, steps: int, repeats: int) -> dict:
  cfg, graphdef, params = decode_model(size)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  low = es.Strategy(population=batch, sigma=0.01, learning_rate=0.1, mode="lowrank", rank=1)
  full = es.Strategy(population=batch, sigma=0.01, learning_rate=0.1, mode="full")
  run_key = low.init(params, jax.random.key(0)).run_key
  versions = jnp.zeros(batch, jnp.int32)
  members = jnp.arange(batch, dtype=jnp.int32)
  rows = jnp.arange(batch, dtype=jnp.int32)

  def decode(params, noiser_fn):
    cache = qwen2.KVCache.init(cfg, batch, steps)
    tokens = jnp.zeros((batch, 1), jnp.int32)

    def step(carry, t):
      cache, tokens = carry
      noiser = noiser_fn()
      logits, cache = qwen2.forward(graphdef, params, tokens, jnp.full((batch, 1), t, jnp.int32),
                                    jnp.ones((batch, 1), bool), cache, noiser)
      return (cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]), None

    (cache, tokens), _ = jax.lax.scan(step, (cache, tokens), jnp.arange(steps))
    return tokens

  plain = jax.jit(lambda p: decode(p, lambda: None))
  cached = jax.jit(lambda p, n: decode(p, lambda: n))
  regen = jax.jit(lambda p: decode(p, lambda: low.member_noiser(p, versions, members, rows, run_key=run_key)))
  full_rows = jax.jit(lambda p, n: decode(p, lambda: n))
  low_noiser = jax.jit(functools.partial(low.member_noiser, run_key=run_key))(params, versions, members, rows)
  full_noiser = jax.jit(functools.partial(full.member_noiser, run_key=run_key))(params, versions, members, rows)
  tokens = batch * steps
  t_plain, t_cached, t_regen, t_full = timed_interleaved(
      [(plain, (params,)), (cached, (params, low_noiser)), (regen, (params,)),
       (full_rows, (params, full_noiser))], repeats=repeats)
  return dict(model=size, params=n_params, batch=batch, steps=steps,
              plain_tok_s=tokens / t_plain, lowrank_tok_s=tokens / t_cached,
              lowrank_regen_tok_s=tokens / t_regen, full_rows_tok_s=tokens / t_full,
              lowrank_vs_plain=t_plain / t_cached, lowrank_regen_vs_plain=t_plain / t_regen,
              full_rows_vs_plain=t_plain / t_full)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dim", type=int, default=2 ** 21)
  parser.add_argument("--population", type=int, default=16)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no-evosax", action="store_true")
  args = parser.parse_args()
  if not args.no_evosax:   # before any timing
    try:
      import evosax  # noqa: F401
    except ImportError:
      parser.exit(2, "perturb_update: evosax is not installed: pip install -e '.[bench]' "
                     "(or --no-evosax to leave its row out)\n")

  out = {"backend": jax.default_backend(), "devices": len(jax.devices())}
  out.update(bench_update(args.dim, args.population, args.repeats, not args.no_evosax))
  out["decode"] = [bench_decode(size, args.batch, args.steps, args.repeats) for size in ("tiny", "small")]

  d, n = out["dim"], out["population"]
  print(f"theta: D = {d:,} float32 ({4 * d / 2**20:.1f} MiB), N = {n}, backend {out['backend']}")
  print(f"{'measurement':52s} {'value':>12s}")
  rows = [
      ("(a) full-rank update [s]", f"{out['full_update_s']:.4f}"),
      ("    one noise generation over theta [s]", f"{out['noise_generation_s']:.4f}"),
      ("    one read+write pass over theta [s]", f"{out['read_write_s']:.4f}"),
      ("    full update / (N x noise generation)", f"{out['full_vs_n_noise']:.2f}x"),
      ("    full update / (N/2 pair draws x noise generation)", f"{out['full_vs_draws']:.2f}x"),
      ("    full update / read+write pass", f"{out['full_vs_read_write']:.1f}x"),
  ]
  rows += [(f"    update temp memory, N={k} [MiB] (theta {4 * d / 2**20:.1f})", f"{v / 2**20:.1f}")
           for k, v in out["full_update_temp_bytes"].items()]
  rows += [
      ("(b) low-rank update (r=1) [s]", f"{out['lowrank_update_s']:.4f}"),
      ("    low-rank update / read+write pass", f"{out['lowrank_vs_read_write']:.1f}x"),
  ]
  for dec in out["decode"]:
    rows += [
        (f"(c) decode {dec['model']} ({dec['params']:,} params, B={dec['batch']}) plain [tok/s]",
         f"{dec['plain_tok_s']:.0f}"),
        ("    low-rank, factors cached per member [tok/s]", f"{dec['lowrank_tok_s']:.0f}"),
        ("    low-rank / plain", f"{dec['lowrank_vs_plain']:.2f}x"),
        ("    low-rank, factors regenerated every step / plain", f"{dec['lowrank_regen_vs_plain']:.2f}x"),
        ("    full-rank, one weight copy per row / plain", f"{dec['full_rows_vs_plain']:.2f}x"),
    ]
  if "evosax_ask_tell_s" in out:
    rows += [
        ("(d) evosax Open_ES ask+tell [s]", f"{out['evosax_ask_tell_s']:.4f}"),
        ("    jaxes full update / evosax ask+tell", f"{out['full_vs_evosax']:.2f}x"),
        ("    evosax temp memory / jaxes full update temp memory", f"{out['evosax_vs_full_temp_memory']:.1f}x"),
    ]
  for name, value in rows:
    print(f"{name:52s} {value:>12s}")
  print(json.dumps(out))


if __name__ == "__main__":
  main()

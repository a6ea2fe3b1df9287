"""Rollout engine decode throughput: unperturbed vs low-rank vs full-rank population decoding.

  python benchmarks/rollout_throughput.py [--hidden 256 --layers 4 --slots 32 --steps 64]

Every slot decodes its own population member (distinct (version, member) per row) through the
same fixed-shape jitted step the trainer uses; the ratio to unperturbed decoding at the same batch
is the number to compare with EGGROLL's ~0.9. Measured side by side in one process.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from jaxes import es
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.policy_bank import ESPolicyBank


def decode_tokens_per_s(graphdef, cfg, params, make_noiser, slots, steps, prompt_len, members):
  engine = Engine(graphdef, cfg, num_slots=slots, max_len=prompt_len + steps + 8,
                  prefill_chunk=prompt_len, max_new_tokens=steps + 4, stop_ids=[], im_end_id=-1,
                  policy=None if make_noiser is None else ESPolicyBank(make_noiser))
  rng = np.random.default_rng(0)

  def run():
    for s in range(slots):
      engine.scheduler.release(s)
      engine.scheduler.start(s, list(rng.integers(10, cfg.vocab_size, prompt_len)), version=0,
                   member=members[s], stream=s)
    engine.step({0: params})          # prefill (+ the first decode step)
    jax.block_until_ready(engine.cache.k)
    t = time.perf_counter()
    for _ in range(steps):
      engine.step({0: params})
    jax.block_until_ready(engine.cache.k)
    return slots * steps / (time.perf_counter() - t)

  run()                               # compile
  return max(run() for _ in range(3))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=2048)
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--steps", type=int, default=48)
  ap.add_argument("--prompt", type=int, default=64)
  a = ap.parse_args()
  cfg = qwen2.Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                          num_layers=a.layers, num_heads=max(a.hidden // 64, 1),
                          num_kv_heads=max(a.hidden // 128, 1), max_position_embeddings=4096)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  members = list(range(a.slots))
  results = {"unperturbed": decode_tokens_per_s(graphdef, cfg, params, None, a.slots, a.steps, a.prompt,
                                                [-1] * a.slots)}
  for mode in ("lowrank", "full"):
    strategy = es.Strategy(population=a.slots, sigma=1e-3, learning_rate=1e-3, mode=mode)
    state = strategy.init(params, jax.random.key(0))
    key = state.run_key
    noiser = lambda p, v, m, g, s=strategy, k=key: s.member_noiser(p, v, m, g, run_key=k)
    results[mode] = decode_tokens_per_s(graphdef, cfg, params, noiser, a.slots, a.steps, a.prompt, members)
  base = results["unperturbed"]
  print(f"decode, {a.slots} slots, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M params, {jax.devices()[0].platform}")
  print("| policy per slot | tokens/s | ratio to unperturbed |")
  print("| --- | ---: | ---: |")
  for name, tps in results.items():
    print(f"| {name} | {tps:.0f} | {tps / base:.2f} |")


if __name__ == "__main__":
  main()

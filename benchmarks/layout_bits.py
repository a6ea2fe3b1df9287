"""Which of a run's programs give the same bits whatever the process layout of its devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/layout_bits.py   # 1 x 8
  launch/local.sh 2 -- python benchmarks/layout_bits.py                                 # 2 x 4

On the demo's model shapes (configs/demo.py) and fixed random inputs, prints one hash per program
family: the warm start (5 AdamW steps, run on each process as the trainer does), the ES update
(32 members' low-rank noise and fitness), and the engine on a data = 8 mesh (32 slots, ragged
prompts and observations, two versions in one call, three turns each: every token and log-prob).
Equal hashes across layouts mean equal bits; docs/multihost.md reads them.
"""
from __future__ import annotations

import hashlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxes import distributed, es
from jaxes.models import partition, qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.policy_bank import ESPolicyBank, VersionSteps
from jaxes.train import warmstart

SLOTS, TURNS, IM_END = 32, 3, 3


def digest(*trees) -> str:
  """A hash of every leaf's bits (gathered whole: every process must call it)."""
  h = hashlib.md5()
  for leaf in jax.tree.leaves(trees):
    h.update(np.asarray(multihost_utils.process_allgather(leaf, tiled=True)
                        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable else leaf).tobytes())
  return h.hexdigest()[:12]


def decode(engine: Engine, params_by_version: dict) -> list:
  """Every slot: a prompt, then TURNS turns, each answered by an observation of its own length."""
  rng = np.random.default_rng(5)
  for slot in range(SLOTS):
    prompt = [int(t) for t in rng.integers(4, 1000, size=int(rng.integers(2, 40)))]
    assert engine.scheduler.start(slot, prompt, version=slot % 2, member=slot, stream=slot,
                        temperature=0.0 if slot % 2 else 0.9, top_p=0.95)
  turns, out = {slot: 0 for slot in range(SLOTS)}, []
  while engine.scheduler.busy():
    for turn in engine.step(params_by_version):
      out.append((turn.slot, np.asarray(turn.tokens, np.int64), np.asarray(turn.logprobs, np.float32)))
      turns[turn.slot] += 1
      if turns[turn.slot] < TURNS:
        observation = np.random.default_rng(100 * turn.slot + turns[turn.slot]).integers(4, 1000, size=1 + 3 * turn.slot)
        assert engine.scheduler.continue_turn(turn.slot, [int(t) for t in observation])
  return out


def main() -> None:
  distributed.initialize()
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=1024, hidden_size=128, intermediate_size=384,
                                 num_layers=2, num_heads=4, num_kv_heads=2)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 1024, size=(64, 256)).astype(np.int32)
  warm, _ = warmstart.train(graphdef, params, tokens, rng.random((64, 256)) < 0.3, steps=5,
                            batch_size=8, learning_rate=3e-3, seed=0, log=lambda s: None)

  mesh = distributed.global_mesh(8)
  params = distributed.place(params, partition.param_shardings(cfg, mesh))
  strategy = es.Strategy(population=SLOTS, sigma=0.015, learning_rate=0.02, mode="lowrank", rank=1,
                         antithetic=True)
  run_key = jax.random.key(0)
  state = strategy.init(params, run_key)
  results = [(0, m, float(f)) for m, f in enumerate(rng.random(SLOTS))]
  updated, _ = strategy.update(state, results)

  def make_noiser(p, versions, members, row_group):
    return strategy.member_noiser(p, versions, members, row_group, run_key=run_key)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  engine = Engine(graphdef, cfg, num_slots=SLOTS, max_len=512, prefill_chunk=64, max_new_tokens=32,
                  stop_ids=[], im_end_id=IM_END, mesh=mesh, policy=ESPolicyBank(
                      make_noiser, version_steps=VersionSteps(strategy.version_step(abstract, run_key),
                                                              SLOTS, 1)))
  engine.policy.add_step(1, *strategy.cohort(state, results))
  turns = decode(engine, {0: params, 1: updated.params})
  line = (f"processes {jax.process_count()} x devices {jax.local_device_count()}: "
          f"warm start {digest(warm)}  ES update {digest(updated.params)}  "
          f"engine {digest([t for turn in turns for t in turn])} ({len(turns)} turns)")
  if jax.process_index() == 0:
    print(line)


if __name__ == "__main__":
  main()

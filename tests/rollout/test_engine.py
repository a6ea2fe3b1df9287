"""Rollout engine: cached continuous batching equals plain uncached decoding, per-slot members
equal materialised perturbed parameters, and shapes never recompile."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_models import es_bank, tiny_model
from jaxes import es
from jaxes.models import qwen2
from jaxes.rollout import sampling
from jaxes.rollout.engine import FREE, PARKED, Engine
from jaxes.train.algorithms import evolution

IM_END = 3


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64)


PAD = 96


@jax.jit
def _last_logits(graphdef, params, tokens, n):
  valid = jnp.arange(PAD)[None] < n
  logits, _ = qwen2.forward(graphdef, params, tokens, jnp.arange(PAD)[None], valid)
  return logits[0, n - 1]


def reference(graphdef, params, ids, max_new):
  """Greedy decoding by re-running the whole (right-padded) sequence without a cache."""
  ids, out = list(ids), []
  for _ in range(max_new):
    tokens = jnp.array([ids + [0] * (PAD - len(ids))], jnp.int32)
    out.append(int(jnp.argmax(_last_logits(graphdef, params, tokens, len(ids)))))
    ids.append(out[-1])
    if out[-1] == IM_END:
      break
  return out


def run_until_turns(engine, params_by_version, n):
  turns = {}
  while len(turns) < n:
    assert engine.scheduler.busy()
    for t in engine.step(params_by_version):
      turns[t.slot] = t
  return turns


def test_multi_turn_continuous_batching_matches_uncached_greedy(model):
  cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, num_slots=4, max_len=96, prefill_chunk=8, max_new_tokens=5,
                  stop_ids=[], im_end_id=IM_END)
  prompts = {0: [5, 6, 7], 1: list(range(10, 31)), 3: [9] * 11}  # slot 2 stays free
  for slot, p in prompts.items():
    assert engine.scheduler.start(slot, p, version=0, member=-1, stream=slot)
  turns = run_until_turns(engine, {0: params}, 3)
  assert engine.scheduler.slots[2].state == FREE
  history = {}
  for slot, p in prompts.items():
    assert turns[slot].tokens == reference(graphdef, params, p, 5)
    assert engine.scheduler.slots[slot].state == PARKED
    history[slot] = p + turns[slot].tokens
  # Second turn for two slots (different observation lengths) while slot 0 stays parked.
  for slot, obs in ((1, [20, 21, 22]), (3, list(range(40, 52)))):
    closing = [] if history[slot][-1] == IM_END else [IM_END]
    assert engine.scheduler.continue_turn(slot, obs)
    history[slot] = history[slot] + closing + obs
  turns = run_until_turns(engine, {0: params}, 2)
  for slot in (1, 3):
    assert turns[slot].tokens == reference(graphdef, params, history[slot], 5)
  assert engine.scheduler.slots[0].state == PARKED and engine.stats.rows_busy < engine.stats.rows_total


def test_each_slot_decodes_its_own_member_and_version(model):
  cfg, graphdef, params = model
  strategy = es.Strategy(population=4, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  state1, _ = strategy.update(state0, [(0, m, float(m)) for m in range(4)])
  engine = Engine(graphdef, cfg, num_slots=4, max_len=64, prefill_chunk=8, max_new_tokens=6,
                  stop_ids=[], im_end_id=IM_END, policy=es_bank(strategy, state0.run_key))
  prompt = [7, 8, 9, 10, 11]
  jobs = {0: (0, 0), 1: (0, 1), 2: (1, 2), 3: (1, -1)}  # slot: (version, member)
  for slot, (v, m) in jobs.items():
    engine.scheduler.start(slot, prompt, version=v, member=m, stream=slot)
  turns = run_until_turns(engine, {0: state0.params, 1: state1.params}, 4)
  states = {0: state0, 1: state1}
  outs = set()
  for slot, (v, m) in jobs.items():
    theta = strategy.perturbed(states[v], (v, m))
    assert turns[slot].tokens == reference(graphdef, theta, prompt, 6), (slot, v, m)
    outs.add(tuple(turns[slot].tokens))
  assert len(outs) > 1  # the perturbations are large enough to change the decoded text


def test_fixed_shapes_compile_once(model):
  cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, num_slots=3, max_len=64, prefill_chunk=4, max_new_tokens=4,
                  stop_ids=[], im_end_id=IM_END)
  rng = np.random.default_rng(0)

  def episodes(k):
    for e in range(k):
      for slot in engine.scheduler.free_slots():
        engine.scheduler.start(slot, list(rng.integers(4, 64, size=int(rng.integers(1, 12)))), version=0,
                     member=-1, stream=e * 3 + slot, temperature=float(rng.uniform(0, 1)), top_p=0.9)
      while engine.scheduler.busy():
        for t in engine.step({0: params}):
          if engine.scheduler.slots[t.slot].length < 40:
            engine.scheduler.continue_turn(t.slot, list(rng.integers(4, 64, size=3)))
          else:
            engine.scheduler.release(t.slot)
      for s in engine.scheduler.slots:
        engine.scheduler.release(s.index)

  episodes(4)
  warm = engine.compilations()
  assert engine.buckets == [1, 3, 7] and engine.spans == [64]
  # One step per (token bucket, span), row reset.
  assert warm <= len(engine.buckets) * len(engine.spans) + 1
  episodes(6)
  assert engine.compilations() == warm


def test_prompt_and_turn_that_do_not_fit_are_refused(model):
  cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, num_slots=1, max_len=16, prefill_chunk=8, max_new_tokens=4,
                  stop_ids=[], im_end_id=IM_END)
  assert not engine.scheduler.start(0, list(range(4, 20)), version=0, member=-1, stream=0)
  assert engine.scheduler.start(0, list(range(4, 12)), version=0, member=-1, stream=0)
  (turn,) = run_until_turns(engine, {0: params}, 1).values()
  assert len(turn.tokens) <= 4 and engine.scheduler.slots[0].length <= 16
  assert not engine.scheduler.continue_turn(0, list(range(4, 12)))
  assert engine.scheduler.slots[0].state == PARKED


def test_sampling_greedy_top_p_and_reproducible_streams():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000, jnp.float32))
  base = jax.random.key(0)
  keys = sampling.row_keys(base, jnp.arange(4000, dtype=jnp.uint32), jnp.zeros(4000, jnp.int32))
  ones, zeros = jnp.ones(4000), jnp.zeros(4000)
  assert (sampling.sample(logits, keys, zeros, ones) == 0).all()          # greedy
  full = np.asarray(sampling.sample(logits, keys, ones, ones))
  freq = np.bincount(full, minlength=4) / 4000
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
  nucleus = np.asarray(sampling.sample(logits, keys, ones, jnp.full(4000, 0.7)))
  assert set(np.unique(nucleus)) == {0, 1}                               # 0.5 + 0.3 >= 0.7
  np.testing.assert_allclose((nucleus == 0).mean(), 0.5 / 0.8, atol=0.03)
  again = sampling.sample(logits, sampling.row_keys(base, jnp.arange(4000, dtype=jnp.uint32),
                                                    jnp.zeros(4000, jnp.int32)), ones, ones)
  assert (np.asarray(again) == full).all()


def test_the_config_key_prefill_tokens_sets_the_engines_largest_token_bucket():
  from jaxes.train import builders, defaults
  config = defaults.base_config()
  config.rollout.update(num_slots=4, max_len=64, prefill_chunk=8, max_new_tokens=5)
  model = builders.build_model(config, 64)
  for tokens, largest in ((0, 4 + 8), (24, 4 + 24)):   # 0: a chunk beside the 4 decode tokens
    config.rollout.prefill_tokens = tokens
    assert builders.build_engine(config, model, None, abstract=True).buckets[-1] == largest


def test_a_policy_bank_serves_one_engine(model):
  """The engine binds its bank to its slots and placement: a second engine needs its own (a
  shared one would key its noisers by the first engine's slots)."""
  from jaxes.rollout.policy_bank import PolicyBank
  cfg, graphdef, _ = model
  bank = PolicyBank()
  args = dict(num_slots=2, max_len=16, prefill_chunk=8, max_new_tokens=4, stop_ids=[],
              im_end_id=IM_END, abstract=True)
  assert Engine(graphdef, cfg, policy=bank, **args).policy is bank
  with pytest.raises(ValueError, match="a policy bank serves one engine"):
    Engine(graphdef, cfg, policy=bank, **args)


def test_the_algorithms_banks_es_members_or_plain_versions():
  """ES decodes through an ``ESPolicyBank`` (members' noise; version steps for an async low-rank
  SGD run), GRPO's engine through the plain bank: the engine itself does not know which."""
  from jaxes.rollout.policy_bank import ESPolicyBank, PolicyBank
  from jaxes.train import builders, defaults
  config = defaults.base_config()
  config.rollout.update(num_slots=4, max_len=64, prefill_chunk=8, max_new_tokens=5)
  config.controller.update(mode="async", max_staleness=2)
  config.es.update(mode="lowrank", optimizer="sgd", population=4)
  model = builders.build_model(config, 64)
  strategy = evolution.build_strategy(config)
  bank = evolution.es_policy_bank(config, model, strategy, jax.random.key(0))
  assert isinstance(bank, ESPolicyBank) and bank.max_steps == 2 and not bank.member_slices
  engine = builders.build_engine(config, model, None, bank, abstract=True)
  assert engine.scheduler.max_steps == 2 and "merge_noisers" in engine.lowerings()
  plain = builders.build_engine(config, model, None, abstract=True)
  assert type(plain.policy) is PolicyBank and plain.scheduler.max_steps is None
  assert "noiser" not in plain.lowerings()

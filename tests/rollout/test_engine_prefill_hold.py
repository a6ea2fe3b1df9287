"""Prefill coalescing (``Engine(prefill_hold=H)``): a new prompt or observation that arrives
while other rows decode waits up to H steps so that prefills arriving a few steps apart share
one call. Held or not, the engine decodes the same tokens; the wait is bounded; no new program
compiles."""
import jax
import pytest

from helpers_models import assert_same_turns, es_bank, ragged_turns, tiny_model
from jaxes import es
from jaxes.rollout.engine import DECODE, PARKED, PREFILL, Engine
from jaxes.rollout.policy_bank import ESPolicyBank

IM_END = 3
SLOTS = 8


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64)


def _engine(model, strategy=None, run_key=None, version_steps=None, **kw):
  cfg, graphdef, _ = model
  policy = es_bank(strategy, run_key, version_steps=version_steps)
  args = dict(num_slots=SLOTS, max_len=64, prefill_chunk=8, max_new_tokens=4, stop_ids=[],
              im_end_id=IM_END, policy=policy)
  return Engine(graphdef, cfg, **{**args, **kw})


def _delta(engine, params_by_version):
  before = dict(vars(engine.stats))
  engine.step(params_by_version)
  return {k: v - before[k] for k, v in vars(engine.stats).items()}


def _parked(model, **kw):
  """An engine of 16 slots (token buckets of 4, 16, 24) whose rows have each decoded a first turn
  and are parked."""
  _, _, params = model
  engine = _engine(model, max_new_tokens=24, num_slots=16, **kw)
  assert engine.buckets == [4, 16, 24]
  for slot in range(16):
    assert engine.scheduler.start(slot, [5 + slot, 6, 7], version=0, member=-1, stream=slot)
  engine.max_new_tokens = 1
  while engine.scheduler.busy():
    engine.step({0: params})
  assert all(s.state == PARKED for s in engine.scheduler.slots)
  engine.max_new_tokens = 24
  return engine


def test_held_prefills_decode_the_same_tokens(model):
  """Two versions (one call group each), greedy and sampled rows, observations coming back at
  different steps: the turns of an engine that holds prefills equal those of one that does not,
  and some prefills were held."""
  _, _, params = model
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  state1, _ = strategy.update(state0, [(0, m, float(m)) for m in range(8)])
  params_by_version = {0: state0.params, 1: state1.params}
  versions = [0, 1, 0, 1, 0, 1, 0]
  # One token per call, so that rows still decode when observations come back (8 per call
  # would end each 6-token turn in the call that feeds its observation).
  now = _engine(model, strategy, state0.run_key, max_new_tokens=6, prefill_hold=0, decode_steps=1)
  held = _engine(model, strategy, state0.run_key, max_new_tokens=6, prefill_hold=3, decode_steps=1)
  want = ragged_turns(now, params_by_version, versions, turns=3)
  got = ragged_turns(held, params_by_version, versions, turns=3)
  assert_same_turns(got, want)
  assert now.stats.prefill_held == 0 and held.stats.prefill_held > 0
  assert held.stats.prefill_calls < now.stats.prefill_calls   # prefills shared calls
  assert held.stats.tokens_prefilled == now.stats.tokens_prefilled


def test_a_prefill_waits_at_most_prefill_hold_steps(model):
  """One observation while other rows decode: held for exactly H steps (no other prefill comes),
  then fed; the decoding rows ran every step meanwhile (one token per step: with decode_steps
  K a held step is up to K decode tokens)."""
  _, _, params = model
  H = 3
  engine = _parked(model, prefill_hold=H, decode_steps=1)
  for slot in (1, 2, 3):
    engine.scheduler.continue_turn(slot, [9])
  _delta(engine, {0: params})                          # nothing decodes yet: they go at once
  assert [engine.scheduler.slots[s].state for s in (1, 2, 3)] == [DECODE] * 3
  engine.scheduler.continue_turn(0, [9, 10])
  pending = len(engine.scheduler.slots[0].pending)
  for _ in range(H):
    d = _delta(engine, {0: params})
    assert (d["prefill_calls"], d["decode_calls"], d["tokens_decoded"]) == (0, 1, 3)
    assert engine.scheduler.slots[0].state == PREFILL
  d = _delta(engine, {0: params})                      # H steps waited: it goes
  assert d["prefill_calls"] == 1 and d["tokens_prefilled"] == pending
  assert engine.scheduler.slots[0].state == DECODE
  assert engine.stats.prefill_held == H


def test_prefills_arriving_apart_share_one_call(model):
  """Observations that come back one step apart are fed together in one call, once the first
  has waited H steps."""
  _, _, params = model
  H = 2
  engine = _parked(model, prefill_hold=H)
  for slot in (4, 5, 6, 7):
    engine.scheduler.continue_turn(slot, [9])
  _delta(engine, {0: params})
  engine.scheduler.continue_turn(0, [9])
  _delta(engine, {0: params})                          # slot 0 held once
  engine.scheduler.continue_turn(1, [9, 10, 11])
  pending = len(engine.scheduler.slots[0].pending) + len(engine.scheduler.slots[1].pending)
  _delta(engine, {0: params})                          # slot 0 twice, slot 1 once
  assert [engine.scheduler.slots[s].state for s in (0, 1)] == [PREFILL] * 2
  d = _delta(engine, {0: params})
  assert d["prefill_calls"] == 1 and d["tokens_prefilled"] == pending
  assert [engine.scheduler.slots[s].state for s in (0, 1)] == [DECODE] * 2
  assert engine.stats.prefill_held == 3


def test_held_prefills_go_when_they_fill_the_smallest_bucket_or_nothing_decodes(model):
  _, _, params = model
  engine = _parked(model, prefill_hold=100)
  engine.scheduler.continue_turn(15, [9])
  _delta(engine, {0: params})                          # nothing else decodes: not held
  assert engine.scheduler.slots[15].state == DECODE and engine.stats.prefill_held == 0
  for slot in (0, 1, 2):
    engine.scheduler.continue_turn(slot, [9])
  _delta(engine, {0: params})
  assert engine.scheduler.slots[0].state == PREFILL and engine.stats.prefill_held == 3
  engine.scheduler.continue_turn(3, [9])                         # four waiting: the smallest bucket's rows
  d = _delta(engine, {0: params})
  assert d["prefill_calls"] == 1 and engine.stats.prefill_held == 3
  assert [engine.scheduler.slots[s].state for s in (0, 1, 2, 3)] == [DECODE] * 4


def test_a_new_prefill_joins_a_row_mid_prefill_at_once(model):
  """A prompt longer than a chunk is mid-prefill for several steps: a new observation of its
  group joins its call at once (that call runs anyway)."""
  _, _, params = model
  engine = _parked(model, prefill_hold=100)
  for slot in (4, 5):
    engine.scheduler.continue_turn(slot, [9])
  engine.scheduler.release(7)
  assert engine.scheduler.start(7, list(range(10, 30)), version=0, member=-1, stream=7)   # 3 chunks of 8
  _delta(engine, {0: params})                          # nothing decodes yet: all go
  assert engine.scheduler.slots[7].state == PREFILL and engine.scheduler.slots[7].held is None     # mid-prefill
  assert [engine.scheduler.slots[s].state for s in (4, 5)] == [DECODE] * 2
  engine.scheduler.continue_turn(0, [9])
  d = _delta(engine, {0: params})
  assert d["prefill_calls"] == 1 and engine.scheduler.slots[0].state == DECODE
  assert engine.stats.prefill_held == 0


def test_holding_compiles_no_new_programs(model):
  """A held engine runs the programs an engine that feeds at once runs (same shapes), so the
  compile count stays that of buckets x spans (plus reset and noiser)."""
  _, _, params = model
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  held = _engine(model, strategy, state0.run_key, max_new_tokens=6, prefill_hold=3)
  ragged_turns(held, {0: state0.params}, [0] * 7, turns=3)
  bound = len(held.buckets) * len(held.spans) + 2
  assert held.compilations() <= bound
  warm = held.compilations()
  for slot in range(7):
    held.scheduler.release(slot)
  ragged_turns(held, {0: state0.params}, [0] * 7, turns=3)
  assert held.compilations() == warm


def test_prefill_hold_must_not_be_negative(model):
  with pytest.raises(ValueError, match="prefill_hold"):
    _engine(model, prefill_hold=-1)


def test_prefill_tokens_set_the_largest_bucket_and_hold_a_chunk(model):
  assert _engine(model, prefill_tokens=32).buckets == [2, SLOTS, SLOTS + 32]
  with pytest.raises(ValueError, match="prefill_tokens=4 must be >= prefill_chunk=8"):
    _engine(model, prefill_tokens=4)


def test_noisers_are_rebuilt_only_for_a_call_with_a_row_started_since(model):
  """A release costs no noiser build; a start costs one when its row joins a call (held, it
  costs none yet). Builds are counted as they run (``jax.debug.callback``)."""
  _, _, params = model
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  builds = []

  def make_noiser(p, versions, members, row_group):
    jax.debug.callback(lambda: builds.append(1))
    return strategy.member_noiser(p, versions, members, row_group, run_key=state0.run_key)

  cfg, graphdef, _ = model
  engine = Engine(graphdef, cfg, num_slots=16, max_len=64, prefill_chunk=8, max_new_tokens=24,
                  stop_ids=[], im_end_id=IM_END, policy=ESPolicyBank(make_noiser), prefill_hold=2,
                  decode_steps=1)   # rows 0-2 still decode while slot 3 is held
  pbv = {0: state0.params}
  for slot in range(4):
    assert engine.scheduler.start(slot, [5 + slot, 6, 7], version=0, member=slot, stream=slot)
  engine.step(pbv)
  jax.effects_barrier()
  assert len(builds) == 1 and all(engine.scheduler.slots[s].state == DECODE for s in range(4))
  engine.scheduler.release(3)
  engine.step(pbv)
  jax.effects_barrier()
  assert len(builds) == 1                              # a free row is in no call
  assert engine.scheduler.start(3, [9, 6, 7], version=0, member=5, stream=3)
  for _ in range(2):                                   # held two steps: not in a call yet
    engine.step(pbv)
  jax.effects_barrier()
  assert len(builds) == 1 and engine.scheduler.slots[3].state == PREFILL
  engine.step(pbv)                                     # it joins a call: one build
  jax.effects_barrier()
  assert len(builds) == 2 and engine.scheduler.slots[3].state == DECODE

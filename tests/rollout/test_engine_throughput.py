"""Row compaction in the rollout engine: a call runs on its working rows only, decodes what the
full-batch path decodes (tokens and behaviour log-probs), and the programs stay few."""
import jax
import numpy as np
import pytest

from helpers_models import assert_same_turns, es_bank, tiny_model
from jaxes import es, sharding
from jaxes.rollout.engine import DECODE, PARKED, PREFILL, Engine

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


def _schedule(engine, params_by_version):
  """Two versions, greedy and sampled slots, ragged prompts; slots come back from their sandbox
  at different steps (some stay parked while others work). Every turn's (tokens, log-probs)."""
  rng = np.random.default_rng(3)
  for slot in range(SLOTS - 1):                    # the last slot stays free
    prompt = list(rng.integers(4, 64, size=int(rng.integers(2, 20))))
    assert engine.scheduler.start(slot, prompt, version=slot % 2, member=slot - 1, stream=slot,
                        temperature=0.0 if slot < 4 else 0.8, top_p=0.9)
  out = {slot: [] for slot in range(SLOTS - 1)}
  waiting, step = {}, 0
  while engine.scheduler.busy() or waiting:
    for slot, due in list(waiting.items()):
      if due <= step:
        del waiting[slot]
        # Drawn from (slot, turn), not in arrival order: the engines end turns at other steps.
        observation = np.random.default_rng(100 * slot + len(out[slot])).integers(4, 64, size=1 + 2 * slot)
        assert engine.scheduler.continue_turn(slot, list(observation))
    for turn in engine.step(params_by_version):
      out[turn.slot].append((turn.tokens, turn.logprobs))
      if len(out[turn.slot]) < 3:
        waiting[turn.slot] = step + 1 + turn.slot % 4   # its command runs for a few steps
    step += 1
  return out


def test_compaction_decodes_the_full_batch_tokens_and_logprobs(model):
  _, _, params = model
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  state1, _ = strategy.update(state0, [(0, m, float(m)) for m in range(8)])
  params_by_version = {0: state0.params, 1: state1.params}
  full = _engine(model, strategy, state0.run_key, compact=False)
  compact = _engine(model, strategy, state0.run_key)
  before = _schedule(full, params_by_version)
  after = _schedule(compact, params_by_version)
  assert_same_turns(after, before)
  assert full.buckets == [SLOTS + 8] and compact.buckets == [2, SLOTS, SLOTS + 8]
  # Compaction computes fewer positions for the same tokens.
  assert compact.stats.positions_computed < full.stats.positions_computed
  assert compact.stats.tokens_decoded == full.stats.tokens_decoded


def test_a_call_runs_only_its_working_rows(model):
  _, _, params = model
  # Every prefill runs when it comes; one token per decode call (the counts below are per step).
  engine = _engine(model, max_new_tokens=6, prefill_hold=0, decode_steps=1)
  for slot in range(SLOTS):
    assert engine.scheduler.start(slot, [5 + slot, 6, 7], version=0, member=-1, stream=slot)
  while engine.scheduler.busy():
    engine.step({0: params})
  assert all(s.state == PARKED for s in engine.scheduler.slots)

  def one_step():
    before = dict(vars(engine.stats))
    engine.step({0: params})
    return {k: v - before[k] for k, v in vars(engine.stats).items()}

  # A short observation into one of 8 rows: the smallest token bucket that holds it.
  engine.scheduler.continue_turn(0, [9])
  pending = len(engine.scheduler.slots[0].pending)         # the turn's last token, im_end, the observation
  d = one_step()
  bucket = next(t for t in engine.buckets if t >= pending)
  assert (d["positions_computed"], d["tokens_prefilled"]) == (bucket, pending)
  assert engine.scheduler.slots[0].state == DECODE
  d = one_step()                                   # it decodes alone: the smallest bucket, 2
  assert (d["positions_computed"], d["tokens_decoded"]) == (2, 1)
  # Four more rows decoding and one prefilling a chunk: one call of 4 + 8 tokens in the bucket
  # of 16, not 8 rows x 8 positions (the chunk's last token goes next call).
  for slot in (1, 2, 3):
    engine.scheduler.continue_turn(slot, [9])
  one_step()
  engine.scheduler.continue_turn(4, list(range(10, 17)))
  assert [s.state for s in engine.scheduler.slots[:5]] == [DECODE] * 4 + [PREFILL]
  d = one_step()
  assert d["prefill_calls"] + d["decode_calls"] == 1
  assert (d["positions_computed"], d["tokens_prefilled"], d["tokens_decoded"]) == (16, 8, 4)


def test_program_count_is_buckets_x_spans(model):
  """The paper config's engine shape (240 slots over data=2, 16384 tokens, chunk 512; a tiny
  model, built abstract: nothing allocated): 3 token buckets per shard (a quarter of its 120
  rows, all of them, all plus a chunk) x 1 span (attention reads key blocks up to the call's
  furthest token, so off GPU one span serves every length) = 3 step programs; 1 without
  compaction, the largest bucket's."""
  cfg, graphdef, _ = model
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  args = dict(num_slots=240, max_len=16384, prefill_chunk=512, max_new_tokens=1024, stop_ids=[],
              im_end_id=IM_END, mesh=mesh, abstract=True)
  engine = Engine(graphdef, cfg, **args)
  assert engine.buckets == [30, 120, 632] and engine.spans == [16384]
  steps = [name for name in engine.programs() if name.startswith("step[")]
  assert sorted(steps) == ["step[t=1264,span=16384]", "step[t=240,span=16384]",
                           "step[t=60,span=16384]"]
  full = Engine(graphdef, cfg, compact=False, **args)
  assert full.buckets == [632]
  assert [n for n in full.programs() if n.startswith("step[")] == ["step[t=1264,span=16384]"]

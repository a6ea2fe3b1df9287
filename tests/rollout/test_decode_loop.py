"""Several decode steps per engine call on the device (``Engine(decode_steps=K)``,
``jaxes.rollout.decode_loop``): the same tokens and log-probs as one step per call (greedy and
sampled rows, two versions, two turns, a paged cache whose loops cross pages), with one host
read per call instead of per token. Full batches only (``compact=False``) to keep the compiles
few: the loop wraps the compacted and version-steps programs the same way, and the other engine
tests (which run with the default ``decode_steps``) compare those against each other."""
import jax
import numpy as np
import pytest

from helpers_models import assert_same_turns, es_bank, ragged_turns, tiny_model
from jaxes import es
from jaxes.rollout import decode_loop
from jaxes.rollout.engine import Engine

IM_END = 3
POP = 8


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64)


def test_tokens_taken_stops_at_the_first_stop_id_or_the_limit():
  tokens = np.array([[5, 3, 7, 3], [5, 6, 7, 3], [3, 6, 0, 0], [9, 0, 0, 0]], np.int32)
  taken, last = decode_loop.tokens_taken(tokens, np.array([4, 3, 1, 0], np.int32), (3,))
  assert taken.tolist() == [2, 3, 1, 0]   # a row mid-prefill (limit 0) sampled nothing
  assert last.tolist() == [3, 7, 3, 0]


def test_device_loop_decodes_the_single_step_tokens_with_pages(model):
  cfg, graphdef, params = model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  state = strategy.init(params, jax.random.key(1))
  results = [(0, m, float((m * 3) % 5)) for m in range(POP)]
  states = [state, strategy.update(state, results)[0]]
  params_by_version = {v: s.params for v, s in enumerate(states)}
  engines = []
  for k in (1, 8):
    # Pages of 4 tokens: an 8-step loop takes the next page before the call; 12-token turns
    # end by the budget mid-loop, and stop ids end others.
    engines.append(Engine(graphdef, cfg, num_slots=8, max_len=64, prefill_chunk=4,
                          max_new_tokens=12, stop_ids=[7], im_end_id=IM_END,
                          policy=es_bank(strategy, state.run_key), compact=False,
                          page_size=4, num_pages=128, decode_steps=k))
  want, got = (ragged_turns(e, params_by_version, [0, 1, 0, 1, 1, 0, 1], observation_growth=2)
               for e in engines)
  assert_same_turns(got, want, atol=1e-5)
  one, loop = (e.stats for e in engines)
  assert loop.tokens_decoded == one.tokens_decoded
  assert loop.loop_steps > loop.decode_calls + loop.prefill_calls   # calls ran several steps
  assert 2 * loop.host_syncs < one.host_syncs
  for engine in engines:
    for slot in range(8):
      engine.scheduler.release(slot)
    assert engine.scheduler.pool.in_use() == 0

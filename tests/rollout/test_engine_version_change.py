"""In-flight version change in the engine (``Scheduler.continue_turn(version=)``): the turns after
the change decode under the newer version's weights with the row's own member noise, over the
cache the older weights wrote; without version steps and with them (the row then joins the newer
version's calls as a step on the base)."""
import jax
import numpy as np
import pytest

from helpers_models import es_bank, tiny_model
from jaxes import es
from jaxes.rollout.engine import Engine
from jaxes.rollout.policy_bank import VersionSteps

POP, MEMBER = 8, 5
PROMPT, OBSERVATION = list(range(4, 16)), [20, 21, 22, 23, 24]


@pytest.fixture(scope="module")
def setup():
  cfg, graphdef, params = tiny_model(vocab_size=64)
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  s0 = strategy.init(params, jax.random.key(1))
  results = [(0, m, float(m % 3)) for m in range(POP)]
  s1 = strategy.update(s0, results)[0]
  return cfg, graphdef, strategy, s0, s1, strategy.cohort(s0, results)


def _engine(setup, version_steps=None):
  cfg, graphdef, strategy, s0, _, _ = setup
  return Engine(graphdef, cfg, num_slots=4, max_len=64, prefill_chunk=8, max_new_tokens=6,
                stop_ids=[], im_end_id=3, policy=es_bank(strategy, s0.run_key, version_steps=version_steps))


def _turn(engine, params_by_version):
  """Steps until row 0's turn ends; its tokens and log-probs."""
  while True:
    for turn in engine.step(params_by_version):
      if turn.slot == 0:
        return list(turn.tokens), np.asarray(turn.logprobs)


def _two_turns(engine, first, second, version=None):
  """Row 0 (member ``MEMBER`` of version 0, sampled) decodes a turn under ``first``, takes the
  observation (moving to ``version`` if given) and decodes the next under ``second``."""
  engine.scheduler.start(0, PROMPT, version=0, member=MEMBER, stream=7, temperature=1.0)
  one = _turn(engine, first)
  assert engine.scheduler.continue_turn(0, OBSERVATION, version=version)
  return one, _turn(engine, second)


def test_the_turn_after_a_change_is_the_new_weights_with_the_members_noise(setup):
  *_, s0, s1, _ = setup
  moved = _two_turns(_engine(setup), {0: s0.params}, {0: s0.params, 1: s1.params}, version=1)
  # The reference: no version change, version 0's weights replaced by version 1's for the turn.
  # Noise of member MEMBER of version 1 instead (a changed noise version) would differ.
  reference = _two_turns(_engine(setup), {0: s0.params}, {0: s1.params})
  stayed = _two_turns(_engine(setup), {0: s0.params}, {0: s0.params})
  for (tokens, logprobs), (want_tokens, want_logprobs) in zip(moved, reference):
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
  assert moved[0][0] == stayed[0][0]   # the first turn is version 0's
  assert moved[1][0] != stayed[1][0]   # the second is not: the new weights took effect


def test_with_version_steps_the_moved_row_runs_as_a_step_on_the_base(setup):
  _, _, strategy, s0, s1, cohort = setup
  steps = VersionSteps(strategy.version_step(s0.params, s0.run_key), POP, 1)
  engine = _engine(setup, steps)
  # A long prompt of version 0 still prefilling when row 0 moves: they share calls.
  engine.scheduler.start(1, list(range(4, 54)), version=0, member=1, stream=1)
  assert engine.policy.add_step(1, *cohort)
  moved = _two_turns(engine, {0: s0.params}, {0: s0.params, 1: s1.params}, version=1)
  reference = _two_turns(_engine(setup), {0: s0.params}, {0: s1.params})
  assert engine.stats.multi_version_calls > 0
  for (tokens, logprobs), (want_tokens, want_logprobs) in zip(moved, reference):
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)

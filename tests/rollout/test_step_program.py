"""step_program.call, the engine's compiled step, driven directly: one flat token buffer holding
two rows' whole prompts and a third row's first chunk; each finished prompt's sample decodes on
the device up to its limit, with the tokens and log-probs the uncached model gives (greedy and
sampled rows), a row mid-prefill samples nothing, and its chunk stays in the cache for the next
call. ``input_shardings`` puts everything with the rows but the key."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_models import tiny_model
from jaxes import sharding
from jaxes.models import partition, qwen2
from jaxes.rollout import step_program
from jaxes.rollout.step_program import Decoding, Samples, SlotSampling, StepInputs, Tokens

MAX_LEN, T, MAX_STEPS, STOP = 32, 8, 4, (3,)
PAD = 16


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64, num_layers=1)


def test_input_shardings_put_everything_but_the_key_with_the_rows():
  assert step_program.input_shardings("rows", "whole") == StepInputs("rows", "rows", "rows", "whole")


@functools.partial(jax.jit, static_argnums=0)
def _uncached_log_probs(graphdef, params, tokens):
  """log-softmax of the next-token logits at every position of ``tokens`` [PAD], no cache."""
  logits, _ = qwen2.forward(graphdef, params, tokens[None], jnp.arange(PAD)[None],
                            jnp.ones((1, PAD), bool))
  return jax.nn.log_softmax(logits[0].astype(jnp.float32))


def _reference(graphdef, params, prompt, tokens):
  """Per sampled token: the greedy token and its log-prob under the uncached model, fed the
  prompt and the tokens sampled before it."""
  ids = list(prompt) + list(tokens)
  logp = np.asarray(_uncached_log_probs(graphdef, params, jnp.array(ids + [0] * (PAD - len(ids)))))
  at = [len(prompt) - 1 + i for i in range(len(tokens))]
  return [int(logp[p].argmax()) for p in at], [float(logp[p, t]) for p, t in zip(at, tokens)]


def _inputs(rows, slots):
  """``rows``: (slot, tokens, first position, limit) fed in order into one T-token buffer."""
  index, tokens, positions, offsets = (np.zeros(T, np.int32) for _ in range(4))
  valid = np.zeros(T, bool)
  sample_at, limit = np.zeros(len(slots[0]), np.int32), np.zeros(len(slots[0]), np.int32)
  used = 0
  for j, (slot, fed, start, row_limit) in enumerate(rows):
    at = slice(used, used + len(fed))
    index[at], tokens[at], valid[at] = slot, fed, True
    positions[at], offsets[at] = start + np.arange(len(fed)), np.arange(len(fed))
    used += len(fed)
    sample_at[j], limit[j] = used - 1, row_limit
  return StepInputs(Tokens(index, tokens, positions, valid, offsets), Samples(sample_at, limit),
                    SlotSampling(*slots), jax.random.key(7))


def test_call_prefills_and_decodes_like_the_uncached_model(model):
  cfg, graphdef, params = model
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  cache_shardings = partition.cache_shardings(cfg, mesh)
  cache_spec = cache_shardings.k.spec
  layout = (mesh, cache_spec[1], cache_spec[3])   # as the engine binds it
  call = jax.jit(functools.partial(step_program.call, graphdef, layout, MAX_STEPS, STOP, False,
                                   MAX_LEN))
  # placed as the call returns it, so that the second call runs the same program
  cache = jax.device_put(qwen2.KVCache.init(cfg, 3, MAX_LEN), cache_shardings)
  # slot 0 greedy, slots 1 and 2 sampled (temperature 1, no nucleus cut; 2: a longer prompt)
  slots = (np.array([0, 1, 2], np.uint32), np.zeros(3, np.int32),
           np.array([0.0, 1.0, 1.0], np.float32), np.ones(3, np.float32))
  prompts = {0: [5, 6, 7], 1: [9, 10], 2: [11, 12, 13, 14, 15]}
  rows = [(0, prompts[0], 0, MAX_STEPS), (1, prompts[1], 0, 2), (2, prompts[2][:2], 0, 0)]
  (tokens, logprobs, taken, last), cache = call(Decoding(params), cache, _inputs(rows, slots))
  tokens, logprobs, taken, last = map(np.asarray, (tokens, logprobs, taken, last))
  assert tokens.shape == logprobs.shape == (3, MAX_STEPS)

  for j, slot in enumerate((0, 1)):
    got = tokens[j, :taken[j]].tolist()
    greedy, want_logprobs = _reference(graphdef, params, prompts[slot], got)
    assert 1 <= taken[j] <= rows[j][3] and last[j] == got[-1]
    assert taken[j] == rows[j][3] or got[-1] in STOP   # the limit, or a stop id
    assert not tokens[j, taken[j]:].any() and not logprobs[j, taken[j]:].any()   # 0 past the end
    if slot == 0:
      assert got == greedy and not logprobs[j, :taken[j]].any()   # greedy: log-prob 0
    else:
      np.testing.assert_allclose(logprobs[j, :taken[j]], want_logprobs, atol=1e-4)
      assert (logprobs[j, :taken[j]] < 0).all()
  assert taken[2] == 0 and not tokens[2].any()   # mid-prefill: computed, ignored

  # Next call: slot 2's prompt goes on from position 2; its first two tokens come from the cache.
  slots[1][:] = [taken[0], taken[1], 0]
  rows = [(2, prompts[2][2:], 2, 1)]
  (tokens, logprobs, taken, _), cache = call(Decoding(params), cache, _inputs(rows, slots))
  assert taken[0] == 1
  sampled, logprob = int(tokens[0, 0]), float(logprobs[0, 0])
  want = _reference(graphdef, params, prompts[2], [sampled])[1][0]
  without_chunk = _reference(graphdef, params, [0, 0] + prompts[2][2:], [sampled])[1][0]
  assert logprob == pytest.approx(want, abs=1e-4) and abs(want - without_chunk) > 1e-3

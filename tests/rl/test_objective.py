"""Chunked teacher-forced log-probs (``objective.chunked_logprobs``): equal to the whole-sequence
path in values and gradients at float32 (padding, masks, a length that is not a multiple of the
chunk, tied and untied heads, top-p), through the learner too, and the compiled gradient never
holds the whole float32 logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_models import tiny_model

from jaxes.rl import objective
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig
from jaxes.rl.grpo import GRPOLearner

T = 38            # 37 targets per row: not a multiple of the chunks below
LENGTHS = (38, 21, 30)


def rows(vocab, seed=0):
  """tokens [3, T]; valid: right padding, and row 2 has a hole; weights on a subset of the
  valid targets (the loss's sampled tokens), 0 on padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (3, T)).astype(np.int32)
  valid = np.arange(T)[None] < np.asarray(LENGTHS)[:, None]
  valid[2, 10:13] = False
  weights = rng.random((3, T)).astype(np.float32) * valid * (rng.random((3, T)) < 0.7)
  weights[:, 0] = 0.0
  return jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(weights)


def weighted_sum(graphdef, chunk, top_p):
  def f(params, tokens, valid, weights):
    logp = objective.sequence_logprobs(graphdef, params, tokens, valid, 0.7, top_p, remat=True,
                                       chunk=chunk)
    return jnp.sum(jnp.where(weights > 0, weights * logp, 0.0)), logp
  return jax.jit(jax.value_and_grad(f, has_aux=True))


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])   # tied and untied LM head
@pytest.mark.parametrize("top_p", [1.0, 0.97])
def test_chunked_logprobs_and_gradients_equal_the_whole_sequence(preset, top_p):
  cfg, graphdef, params = tiny_model(preset, vocab_size=512)
  tokens, valid, weights = rows(cfg.vocab_size)
  (total0, logp0), grads0 = weighted_sum(graphdef, 0, top_p)(params, tokens, valid, weights)
  if top_p < 1:  # some random targets fall outside the nucleus: -inf, with weight 0 there
    assert np.isinf(np.asarray(logp0)).any()
    weights = jnp.where(jnp.isfinite(logp0), weights, 0.0)
    (total0, logp0), grads0 = weighted_sum(graphdef, 0, top_p)(params, tokens, valid, weights)
  assert np.isfinite(float(total0))
  for chunk in (5, 37):  # 37 = all the targets: one chunk, the whole-sequence path itself
    (total, logp), grads = weighted_sum(graphdef, chunk, top_p)(params, tokens, valid, weights)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp0), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(float(total), float(total0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  # The padded positions carry no gradient: moving a padding token changes nothing.
  moved = tokens.at[1, 30].set((tokens[1, 30] + 1) % cfg.vocab_size)
  (total1, _), grads1 = weighted_sum(graphdef, 5, top_p)(params, moved, valid, weights)
  assert float(total1) == pytest.approx(float(total0), rel=1e-6)
  for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_the_learner_with_chunked_logprobs_equals_the_whole_sequence_learner():
  cfg, graphdef, params = tiny_model("tiny-gqa", vocab_size=512)
  tokens, valid, weights = rows(cfg.vocab_size, seed=1)
  tokens, valid = jnp.tile(tokens, (2, 1)), jnp.tile(valid, (2, 1))
  sampled = jnp.tile(weights > 0, (2, 1))
  behaviour = objective.sequence_logprobs(graphdef, params, tokens, valid, 1.0, 1.0) + 0.05
  batch = Batch(tokens, valid, sampled, jnp.where(sampled, behaviour, 0.0),
                jnp.array([1.0, 0.0, 0.5, 0.2, 0.9, 0.0]), jnp.array([0, 0, 0, 1, 1, 1]))
  out = [GRPOLearner(graphdef, GRPOConfig(micro_batches=2, logprob_chunk=k, kl_coef=0.1))
         .loss_and_grads(params, params, batch) for k in (0, 8)]
  np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[0][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
  for key in out[0][2]:
    np.testing.assert_allclose(out[1][2][key], out[0][2][key], rtol=1e-5, atol=1e-7)


def test_the_chunked_gradient_never_holds_the_whole_logits():
  """With a vocabulary large enough that [B, T, V] float32 dominates, the compiled gradient's
  temporaries stay below one such array when chunked, and exceed it when not."""
  cfg, graphdef, params = tiny_model("tiny", vocab_size=16384)
  S = jax.ShapeDtypeStruct
  B, L = 2, 256
  logits_bytes = B * (L - 1) * cfg.vocab_size * 4

  def temporaries(chunk):
    def f(p, tokens, valid):
      return objective.sequence_logprobs(graphdef, p, tokens, valid, 1.0, 1.0, remat=True,
                                         chunk=chunk).sum()
    compiled = jax.jit(jax.grad(f)).lower(params, S((B, L), jnp.int32), S((B, L), bool)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  whole, chunked = temporaries(0), temporaries(32)
  assert whole > logits_bytes, (whole, logits_bytes)
  assert chunked < logits_bytes / 2, (chunked, logits_bytes)

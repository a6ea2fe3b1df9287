"""Next-token sampling per batch row: greedy, temperature, nucleus (top-p), and the log-prob of
each sampled token under the distribution it was drawn from.

That distribution (``nucleus_logits``) is softmax(logits / temperature) restricted to the nucleus
and renormalised; at temperature 0 it is the point mass on the argmax (log-prob 0). The GRPO
learner's teacher-forced log-probs go through the same function, so the importance ratio compares
like with like.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(base_key: jax.Array, streams: jax.Array, counters: jax.Array) -> jax.Array:
  """One key per row from (stream id, token counter): a row's samples do not depend on which
  other rows share its batch, so an episode's tokens are reproducible under any scheduling."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(base_key, s), c))(streams, counters)


def nucleus_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits float32 [..., V]; temperature, top_p broadcastable to logits.shape[:-1]. Returns the
  logits of the sampling distribution: ``logits / temperature`` where a token is in the
  nucleus (the smallest set of most likely tokens whose mass reaches top_p, at least one),
  -inf elsewhere."""
  batch_shape, vocab = logits.shape[:-1], logits.shape[-1]
  flat = logits.reshape(-1, vocab)
  temperature = jnp.broadcast_to(temperature, batch_shape).reshape(-1)
  top_p = jnp.broadcast_to(top_p, batch_shape).reshape(-1)
  scaled = flat / jnp.maximum(temperature, 1e-6)[:, None]
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = mass_before < top_p[:, None]
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(flat.shape[0])[:, None], order].set(keep_sorted)
  return jnp.where(keep, scaled, -jnp.inf).reshape(logits.shape)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits float32 [B, V]; keys [B]; temperature, top_p float32 [B] (temperature 0 = greedy).
  Returns int32 [B]."""
  return _draw(logits, nucleus_logits(logits, temperature, top_p), keys, temperature)


def _draw(logits, masked, keys, temperature):
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array,
                   top_p: jax.Array) -> jax.Array:
  """float32 [...]: log-prob of ``tokens`` [...] under the sampling distribution of ``logits``
  [..., V] (see the module docstring); 0 where temperature is 0 (greedy is deterministic) and
  -inf for a token outside the nucleus. Differentiable in the logits (nucleus membership is not)."""
  return _picked_logprobs(nucleus_logits(logits, temperature, top_p), tokens, temperature)


def _picked_logprobs(masked, tokens, temperature):
  logp = jax.nn.log_softmax(masked, axis=-1)
  picked = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.where(jnp.broadcast_to(temperature, tokens.shape) > 0, picked, 0.0)


def sample_with_logprob(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                        top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``sample`` (the same tokens for the same keys) and each token's ``token_logprobs``, the
  behaviour log-prob a policy-gradient learner needs. Returns (int32 [B], float32 [B])."""
  def sampled():
    masked = nucleus_logits(logits, temperature, top_p)
    tokens = _draw(logits, masked, keys, temperature)
    return tokens, _picked_logprobs(masked, tokens, temperature)

  def greedy():   # what ``sampled`` returns when every row is greedy, without its vocabulary sort
    return (jnp.argmax(logits, axis=-1).astype(jnp.int32),
            jnp.zeros(logits.shape[:-1], jnp.float32))

  # The nucleus sorts each row's vocabulary (on the CPU ~14 ms a row at 49k tokens, more than a
  # 135M model's whole decode step); a batch of greedy rows (ES's rollouts, evaluation) skips it.
  return jax.lax.cond(jnp.any(temperature > 0), sampled, greedy)

"""GRPO's pieces as pure functions: group-relative advantages, per-token loss weights, the
clipped-ratio loss with an optional k3 KL penalty, teacher-forced log-probs.

Every quantity the learner sums is ``sum(weights * per_token_value)`` with weights computed once
from the whole batch (``token_weights``), so splitting the rows into micro-batches and adding
their sums gives the full batch's value exactly (up to float rounding).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxes.models import qwen2
from jaxes.rl.config import ADVANTAGES, AGGREGATIONS
from jaxes.rollout import sampling


def group_advantages(rewards: jax.Array, group_ids: jax.Array, kind: str = "zscore",
                     eps: float = 1e-6) -> jax.Array:
  """float32 [N]: ``r - mean_group`` ("centered", Dr.GRPO) or ``(r - mean_group) / (std_group +
  eps)`` ("zscore", GRPO), std over the group's episodes (ddof 0). Rows with ``group_ids`` -1
  (padding) get 0."""
  if kind not in ADVANTAGES:
    raise ValueError(f"advantage kind must be one of {ADVANTAGES}, got {kind!r}")
  n = rewards.shape[0]
  real = group_ids >= 0
  seg = jnp.where(real, group_ids, n)  # padding goes to an extra segment that nobody reads
  r = jnp.where(real, rewards.astype(jnp.float32), 0.0)
  count = jax.ops.segment_sum(real.astype(jnp.float32), seg, num_segments=n + 1)
  mean = jax.ops.segment_sum(r, seg, num_segments=n + 1) / jnp.maximum(count, 1.0)
  centered = r - mean[seg]
  if kind == "centered":
    return jnp.where(real, centered, 0.0)
  var = jax.ops.segment_sum(centered ** 2, seg, num_segments=n + 1) / jnp.maximum(count, 1.0)
  return jnp.where(real, centered / (jnp.sqrt(var)[seg] + eps), 0.0)


def token_weights(sampled: jax.Array, aggregation: str) -> jax.Array:
  """float32 [N, S] weights on the sampled tokens: "token" averages over every sampled token of
  the batch (DAPO, Dr.GRPO); "sequence" averages each episode over its own tokens, then over the
  episodes that have any (the original GRPO)."""
  m = sampled.astype(jnp.float32)
  if aggregation == "token":
    return m / jnp.maximum(m.sum(), 1.0)
  if aggregation == "sequence":
    per_row = m.sum(axis=1, keepdims=True)
    rows = jnp.maximum((per_row > 0).sum(), 1)
    return m / jnp.maximum(per_row, 1.0) / rows
  raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def sequence_logprobs(graphdef, params, tokens: jax.Array, valid: jax.Array, temperature: float,
                      top_p: float, remat: bool = False, chunk: int = 0) -> jax.Array:
  """float32 [N, S]: teacher-forced log-prob of ``tokens[:, t]`` given the tokens before it,
  under the sampling distribution (``sampling.token_logprobs``); column 0 is 0. ``remat``: the
  model's layers under ``jax.checkpoint`` (``Qwen2ForCausalLM``'s ``remat``), for a gradient that
  keeps one layer's activations. ``chunk`` > 0: the LM head and log-softmax run ``chunk`` positions at a
  time (``chunked_logprobs``), so the float32 logits [N, S, V] never exist whole."""
  return sequence_logprobs_and_hidden(graphdef, params, tokens, valid, temperature, top_p,
                                      remat=remat, chunk=chunk)[0]


def sequence_logprobs_and_hidden(graphdef, params, tokens: jax.Array, valid: jax.Array,
                                 temperature: float, top_p: float, remat: bool = False,
                                 chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """``sequence_logprobs`` and the trunk's last hidden states [N, S, d] it was computed from
  (position t: the state after reading tokens 0..t), for a head that reads the same forward
  (a value head)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  model = nnx.merge(graphdef, params)
  hidden, _ = model(tokens, positions, valid, options=qwen2.Options(remat=remat, head=False))
  logp = chunked_logprobs(model.lm_logits, hidden[:, :-1], tokens[:, 1:], temperature, top_p, chunk)
  return jnp.pad(logp, ((0, 0), (1, 0))), hidden


def chunked_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                     temperature: float, top_p: float, chunk: int = 0) -> jax.Array:
  """float32 [B, T]: log-prob of ``targets`` [B, T] under the sampling distribution of
  ``head(hidden)`` (float32 logits [B, T, V] of hidden states [B, T, d]).

  ``chunk`` > 0 and < T: ``chunk`` positions at a time (T padded up to a multiple), each under
  ``jax.checkpoint`` in a ``lax.map``, so forward and backward hold one chunk's [B, chunk, V]
  logits and the backward recomputes them; equal to the whole-sequence path (``chunk`` 0) up to
  float rounding. Every chunk keeps the whole vocabulary, so its log-softmax is exact as it
  stands; with the head sharded over ``tensor`` the vocabulary reduction stays a collective
  across the shards. (jax-cce's fused linear cross-entropy chunks the vocabulary instead: it
  would slice a ``tensor``-sharded head across its shards, and it has no top-p nucleus.)"""
  if not chunk or chunk >= targets.shape[1]:
    return _picked_logprobs(head(hidden), targets, temperature, top_p)
  B, T = targets.shape
  n = -(-T // chunk)
  pad = n * chunk - T  # padded positions: finite logits of zero hidden states, sliced off below
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
  targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

  @functools.partial(jax.checkpoint, prevent_cse=False)  # in a loop: no CSE to prevent
  def one(xs):
    h, t = xs
    return _picked_logprobs(head(h), t, temperature, top_p)

  logp = jax.lax.map(one, (hidden, targets))  # [n, B, chunk]
  return logp.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]


def _picked_logprobs(logits, targets, temperature, top_p):
  # At top_p 1 the nucleus is the whole vocabulary (up to tokens of probability below float
  # rounding), so the per-position sort over the vocabulary is skipped.
  if top_p >= 1.0:
    scaled = logits / temperature
    picked = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)
  return sampling.token_logprobs(logits, targets, jnp.float32(temperature), jnp.float32(top_p))


def clipped_objective(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
                      weights: jax.Array, *, clip_low: float, clip_high: float,
                      ref_logp: jax.Array | None = None, kl_coef: float = 0.0
                      ) -> tuple[jax.Array, dict]:
  """PPO's clipped surrogate, negated, against the behaviour policy, plus ``kl_coef`` times
  Schulman's k3 estimate of KL(policy || reference) per token; ``advantages`` [N] are broadcast
  over each episode's tokens. Returns (loss, weighted sums: pg_loss, kl, clip_fraction, ratio).
  Tokens with weight 0 contribute nothing, whatever their values."""
  on = weights > 0
  # Zero the log-ratio off the targets so padding and context never make inf/NaN in the backward.
  log_ratio = jnp.where(on, logp - behaviour_logp, 0.0)
  ratio = jnp.exp(log_ratio)
  adv = advantages[:, None]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
  pg = -jnp.minimum(unclipped, clipped)
  was_clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
  per_token = pg
  kl = jnp.zeros_like(pg)
  if ref_logp is not None:
    # k3 = exp(d) - d - 1 with d = log(ref / policy): unbiased, non-negative, low variance.
    # d is clipped (as verl does) so a token outside one nucleus cannot make it infinite.
    d = jnp.clip(jnp.where(on, ref_logp - logp, 0.0), -20.0, 20.0)
    kl = jnp.exp(d) - d - 1.0
    per_token = pg + kl_coef * kl
  sums = dict(pg_loss=jnp.sum(weights * pg), kl=jnp.sum(weights * kl),
              clip_fraction=jnp.sum(weights * was_clipped), ratio=jnp.sum(weights * ratio))
  return jnp.sum(weights * per_token), sums

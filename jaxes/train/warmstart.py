"""Supervised warm start on oracle transcripts (the CPU demo's stand-in for an Instruct model).

Oracle transcripts (``jaxes.envs.tasks.oracle``) are real episodes played by the tasks' reference
solutions. Training is plain next-token cross-entropy on the
assistant tokens (``chat.transcript_ids``) with AdamW, a few hundred steps at most.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxes.models import qwen2
from jaxes.models.noiser import FixedOrderGradNoiser
from jaxes.rollout import chat


def encode(tok, transcripts, seq_len: int, observation_weight: float = 0.0
           ) -> tuple[np.ndarray, np.ndarray]:
  """``tokens [N, seq_len]`` int32 and ``loss_weights [N, seq_len]`` float32: the weight of
  predicting the *next* token, 1 for an assistant token and ``observation_weight`` for any other
  (system prompt, task, observations). Long transcripts are cut at ``seq_len``."""
  tokens = np.zeros((len(transcripts), seq_len), np.int32)
  weights = np.zeros((len(transcripts), seq_len), np.float32)
  for i, messages in enumerate(transcripts):
    ids, assistant = chat.transcript_ids(tok, messages)
    ids, assistant = ids[:seq_len], np.asarray(assistant[:seq_len], bool)
    tokens[i, :len(ids)] = ids
    weights[i, :len(ids) - 1] = np.where(assistant[1:], 1.0, observation_weight)
  return tokens, weights


def _nll_sum(params, graphdef, tokens, weights):
  """Next-token NLL summed over the positions of ``tokens [N, T]``, weighted by ``weights``."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  valid = jnp.ones(tokens.shape, bool)
  logits, _ = qwen2.forward(graphdef, params, tokens, positions, valid, noiser=FixedOrderGradNoiser())
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(nll * weights[:, :-1].astype(jnp.float32))


def loss_and_grads(params, graphdef, tokens, weights):
  """The batch's NLL per unit of loss weight (``encode``) and its gradient, summed one sequence
  at a time in a fixed order, each kernel gradient over fixed chunks of positions
  (``FixedOrderGradNoiser``). Why: on XLA:CPU a batched gradient's long contractions are split
  over the intra-op threads, whose number follows the process's device count, so the bits would
  depend on how the run's devices are split into processes (a 2-process rehearsal would start
  from another warm start than its 1-process run)."""
  grad_one = jax.value_and_grad(_nll_sum)

  def add(total, example):
    nll, grads = grad_one(params, graphdef, example[0][None], example[1][None])
    return jax.tree.map(jnp.add, total, (nll, grads)), None

  zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (nll, grads), _ = jax.lax.scan(add, zero, (tokens, weights))
  total = weights[:, :-1].astype(jnp.float32).sum()
  count = jnp.where(total > 0, total, 1.0)
  return nll / count, jax.tree.map(lambda g: g / count, grads)


def train(graphdef, params, tokens: np.ndarray, weights: np.ndarray, *, steps: int, batch_size: int,
          learning_rate: float, seed: int, log_every: int = 50, log=print):
  """``steps`` AdamW steps on random batches; returns (params, list of (step, loss))."""
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(steps // 10, 1), max(steps, 2)),
                   weight_decay=0.0)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tokens, weights):
    loss, grads = loss_and_grads(params, graphdef, tokens, weights)
    grads, _ = optax.clip_by_global_norm(1.0).update(grads, None)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  history = []
  for i in range(steps):
    idx = rng.choice(len(tokens), size=min(batch_size, len(tokens)), replace=False)
    params, opt_state, loss = step(params, opt_state, tokens[idx], weights[idx])
    if (i + 1) % log_every == 0 or i + 1 == steps:
      history.append((i + 1, float(loss)))
      log(f"warm start step {i + 1}/{steps}: loss {float(loss):.3f} per unit of loss weight")
  return params, history

"""Several decode steps in one engine call: sampled tokens feed the next step on the device.

After an engine call's first step (``step_program.call``) each row's sampled token is fed back
in a ``lax.while_loop`` of further decode steps. Each row has a ``limit``, computed by the host
before the call: the tokens it may sample in this call — at most ``max_steps``, its turn's
remaining token budget and, with a paged cache, the positions its pages already hold (pages are
taken on the host between calls). A row stays alive until it samples a stop id or reaches its
limit; a dead row is fed as invalid (its cache row untouched), and the loop ends when no row is
alive. The program also returns each row's count of sampled tokens and the last of them
(``tokens_taken``, replicated): the host reads them and its own rows' ``[n, max_steps]`` tokens
once per call, so it learns of stops one call late at most, with one device-to-host transfer per
call instead of per token, and a process of a multi-process run reads no other process's rows.

A row's tokens are those of one step per call: its sampling key is ``(stream, counter)`` with
the counter advanced per sampled token, and its cache row sees the same tokens at the same
positions (``tests/rollout/test_decode_loop.py``).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def run(decode: Callable, cache, first: tuple, at: jax.Array, limit: jax.Array, max_steps: int,
        stop_ids: tuple):
  """``decode(cache, fed [n], positions [n], alive [n], i) -> ((tokens [n], logprobs [n]),
  cache)``: one decode step of the rows, the i-th token each samples in this call. ``first``:
  the rows' first sampled ``(tokens [n], logprobs [n])``, to be fed at positions ``at [n]``.
  Returns ``((tokens [n, max_steps], logprobs [n, max_steps]), cache)``; entries past a row's
  last sampled token are 0."""
  stops = jnp.asarray(stop_ids, jnp.int32)
  sampled, logprob = first
  taken = limit > 0
  out_tokens = jnp.zeros((sampled.shape[0], max_steps), jnp.int32).at[:, 0].set(
      jnp.where(taken, sampled, 0))
  out_logprobs = jnp.zeros((sampled.shape[0], max_steps), jnp.float32).at[:, 0].set(
      jnp.where(taken, logprob, 0.0))

  def stopped(tokens):
    return (tokens[:, None] == stops[None, :]).any(axis=1)

  def body(carry):
    i, cache, fed, alive, out_tokens, out_logprobs = carry
    (sampled, logprob), cache = decode(cache, fed, at + i - 1, alive, i)
    out_tokens = out_tokens.at[:, i].set(jnp.where(alive, sampled, 0))
    out_logprobs = out_logprobs.at[:, i].set(jnp.where(alive, logprob, 0.0))
    alive = alive & ~stopped(sampled) & (i + 1 < limit)
    return i + 1, cache, jnp.where(alive, sampled, fed), alive, out_tokens, out_logprobs

  def more(carry):
    i, _, _, alive, _, _ = carry
    return (i < max_steps) & alive.any()

  if max_steps == 1:   # nothing to loop over (static): the program holds the first step only
    return (out_tokens, out_logprobs), cache
  alive = taken & ~stopped(sampled) & (limit > 1)
  _, cache, _, _, out_tokens, out_logprobs = jax.lax.while_loop(
      more, body, (jnp.int32(1), cache, sampled, alive, out_tokens, out_logprobs))
  return (out_tokens, out_logprobs), cache


def tokens_taken(tokens: jax.Array, limit: jax.Array, stop_ids: tuple) -> tuple[jax.Array, jax.Array]:
  """Per row of ``run``'s ``tokens [n, max_steps]``: how many it sampled (up to and including its
  first stop id, at most ``limit``: the loop's rule) and the last of them (0 when none). Computed
  in the program, so that every process learns them without reading the rows' tokens."""
  stops = jnp.asarray(stop_ids, jnp.int32)
  steps = jnp.arange(tokens.shape[1])
  stop = (tokens[:, :, None] == stops).any(axis=2) & (steps[None, :] < limit[:, None])
  taken = jnp.where(stop.any(axis=1), jnp.argmax(stop, axis=1) + 1, limit)
  last = jnp.take_along_axis(tokens, jnp.maximum(taken - 1, 0)[:, None], axis=1)[:, 0]
  return taken, jnp.where(taken > 0, last, 0)

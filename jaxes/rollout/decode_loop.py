"""Several decode steps in one engine call: sampled tokens feed the next step on the device.

A width-1 engine call (every row decodes one token, or feeds the last token of its prefill) runs
as a ``lax.while_loop`` of up to ``max_steps`` steps of the engine's one-step program. Each row
has a ``limit``, computed by the host before the call (``limits``): the tokens it may sample in
this call — at most ``max_steps``, its turn's remaining token budget and, with a paged cache, the
positions its pages already hold (a page is taken on the host between calls, as before). On the
device a row stays alive until it samples a stop id or reaches its limit; a dead row is fed as
invalid (its cache row untouched), and the loop ends when no row is alive or after ``n_steps``
(a traced scalar: one compiled program serves every step count). The host reads the ``[n,
max_steps]`` tokens once per call and replays the same rule (``tokens_taken``), so it learns of
stops one call late at most, with one device-to-host transfer per call instead of per token.

A row's tokens are those of the one-step engine: its sampling key is ``(stream, counter)`` with
the counter advanced per sampled token, and its cache row sees the same tokens at the same
positions (``tests/test_engine_decode_loop.py``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def run(step: Callable, cache_at: int, max_steps: int, stop_ids: tuple, attend_len: int, *args):
  """``step(attend_len, *head, tokens, positions, valid, base_key, streams, counters,
  temperature, top_p) -> ((tokens [n], logprobs [n]), cache)``, the engine's one-step program
  with ``head[cache_at]`` its cache. ``args`` = ``(*head, tokens [n, 1], positions [n, 1], valid
  [n, 1], base_key, streams, counters, temperature, top_p, limit [n], n_steps [])``. Returns
  ``((tokens [n, max_steps], logprobs [n, max_steps]), cache)``; entries past a row's last
  sampled token are 0."""
  *head, tokens, positions, valid, base_key, streams, counters, temperature, top_p, limit, n_steps = args
  stops = jnp.asarray(stop_ids, jnp.int32)
  n = tokens.shape[0]
  out_tokens = jnp.zeros((n, max_steps), jnp.int32)
  out_logprobs = jnp.zeros((n, max_steps), jnp.float32)
  alive = valid[:, 0] & (limit > 0)

  def body(carry):
    i, cache, fed, alive, out_tokens, out_logprobs = carry
    call = list(head)
    call[cache_at] = cache
    (sampled, logprob), cache = step(attend_len, *call, fed[:, None], positions + i, alive[:, None],
                                     base_key, streams, counters + i, temperature, top_p)
    out_tokens = out_tokens.at[:, i].set(jnp.where(alive, sampled, 0))
    out_logprobs = out_logprobs.at[:, i].set(jnp.where(alive, logprob, 0.0))
    stopped = (sampled[:, None] == stops[None, :]).any(axis=1)
    alive = alive & ~stopped & (i + 1 < limit)
    return i + 1, cache, jnp.where(alive, sampled, fed), alive, out_tokens, out_logprobs

  def more(carry):
    i, _, _, alive, _, _ = carry
    return (i < jnp.minimum(n_steps, max_steps)) & alive.any()

  _, cache, _, _, out_tokens, out_logprobs = jax.lax.while_loop(
      more, body, (jnp.int32(0), head[cache_at], tokens[:, 0], alive, out_tokens, out_logprobs))
  return (out_tokens, out_logprobs), cache


def tokens_taken(tokens: Sequence[int], limit: int, stop_ids) -> int:
  """How many of a row's call outputs it sampled: up to and including its first stop id, at most
  ``limit`` (the device loop's rule, replayed on the host)."""
  for i in range(limit):
    if int(tokens[i]) in stop_ids:
      return i + 1
  return limit

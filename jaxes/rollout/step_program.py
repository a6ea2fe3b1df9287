"""The engine's compiled step: one program per token bucket, for every kind of call.

An engine call is a flat buffer of tokens — prefill chunks and decode tokens of any rows, of any
live versions — ``T`` per data shard (a token bucket, ``Engine.buckets``), each token naming its
cache row (shard-local, ``attention.Rows``) and its offset among that row's tokens of the call
(the ragged ``qwen2.Options.token_offsets``). Each row of the call has one *sample*: the last
of its tokens, whose logits give the row's next token. ``S = min(T, rows per shard)`` samples
per shard hold every row a call can have, so the LM head runs on S positions per shard, not T.

After that first step the program decodes on the device (``decode_loop``): each sample whose
``limit`` (tokens it may sample in this call, set by the host) is above one feeds its sampled
token back at the next position, up to ``max_steps`` tokens or a stop id. A row mid-prefill (its
prompt goes on in the next call) has limit 0, so its sample is computed and ignored. The program
is the same for a call of decode tokens only, of prefill chunks only, or of both: what varies
is data, never shapes, so a bucket is one program (two with ``steps``: rows of several versions,
each row's version a few low-rank steps on from the call's base, ``PopulationNoiser.with_steps``).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxes.models import attention, qwen2
from jaxes.rollout import decode_loop, sampling


def call(graphdef, layout: tuple, max_steps: int, stop_ids: tuple, paged: bool, attend_len: int,
         params, noiser, cache, index, tokens, positions, valid, offsets, sample_at, base_key,
         streams, counters, temperature, top_p, limit, steps=None, step_rows=None):
  """One engine call. Static: ``layout`` (``attention.Rows``'s mesh, batch and KV-head axes),
  ``max_steps``, ``stop_ids``, ``paged`` (the cache is a ``PagedKVCache``), ``attend_len``.
  Per flat token ``[D * T]``: ``index`` (its cache row in its shard), ``tokens``, ``positions``,
  ``valid``, ``offsets``. Per sample ``[D * S]``: ``sample_at`` (its token's place in its
  shard's T tokens) and ``limit``. Per slot ``[B]``: ``streams``, ``counters`` (tokens the slot
  has sampled), ``temperature``, ``top_p`` and, with ``steps``, ``step_rows [B, K]``. Returns
  ``((tokens [D * S, max_steps], logprobs [D * S, max_steps], taken [D * S], last [D * S]),
  cache)``: entries past a sample's last sampled token are 0; ``taken`` and ``last`` are each
  sample's count of sampled tokens and the last of them (``decode_loop.tokens_taken``)."""
  if steps is not None:
    noiser = noiser.with_steps(steps, step_rows)
  flat = attention.Rows(index, *layout)
  samples = attention.Rows(sample_at, *layout)
  rows = attention.Rows(samples.take(index), *layout)   # each sample's cache row

  def access_of(batch_rows):
    return (attention.Pages(batch_rows.take(cache.table), *layout, rows=batch_rows) if paged
            else batch_rows)

  def noiser_of(batch_rows):
    return None if noiser is None else noiser.select_rows(batch_rows.take)

  hidden, cache = qwen2.forward(
      graphdef, params, tokens[:, None], positions[:, None], valid[:, None], cache=cache,
      noiser=noiser_of(flat), options=qwen2.Options(
          access=access_of(flat), token_offsets=offsets[:, None], attend_len=attend_len,
          head=False))
  row_noiser = noiser_of(rows)
  logits = nnx.merge(graphdef, params).lm_logits(samples.take(hidden[:, 0]), row_noiser)
  streams, counters, temperature, top_p = (rows.take(x) for x in (streams, counters, temperature,
                                                                  top_p))
  first = sampling.sample_with_logprob(
      logits, sampling.row_keys(base_key, streams, counters), temperature, top_p)

  def decode(cache, fed, at, alive, i):
    """One decode step of the samples: ``fed [S']`` at positions ``at``, the i-th token of the
    call (the sampling counter's offset)."""
    logits, cache = qwen2.forward(
        graphdef, params, fed[:, None], at[:, None], alive[:, None], cache=cache,
        noiser=row_noiser, options=qwen2.Options(
            logits_at=jnp.zeros_like(fed), access=access_of(rows), attend_len=attend_len,
            bounded_keys=True))
    keys = sampling.row_keys(base_key, streams, counters + i)
    return sampling.sample_with_logprob(logits, keys, temperature, top_p), cache

  (out_tokens, out_logprobs), cache = decode_loop.run(
      decode, cache, first, samples.take(positions) + 1, limit, max_steps, stop_ids)
  return (out_tokens, out_logprobs, *decode_loop.tokens_taken(out_tokens, limit, stop_ids)), cache

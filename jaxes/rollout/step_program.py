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

from typing import Any, NamedTuple

import jax.numpy as jnp
from flax import nnx

from jaxes.models import attention, qwen2
from jaxes.rollout import decode_loop, sampling


class Decoding(NamedTuple):
  """What a call's rows decode with (``jaxes.rollout.policy_bank``): the base version's ``params``
  and the rows' ``noiser`` (None: unperturbed)."""
  params: Any
  noiser: Any = None


class Steps(NamedTuple):
  """Rows of several versions in one call: K low-rank steps on top of the base version, shared by
  the rows (``factors``, ``PopulationNoiser.with_steps``), and ``rows [B, K]``: 1 where slot b
  adds step k."""
  factors: Any
  rows: Any


class Tokens(NamedTuple):
  """Per flat token ``[D * T]``: its cache row in its shard, id, position, validity and offset
  among its row's tokens of the call."""
  index: Any
  tokens: Any
  positions: Any
  valid: Any
  offsets: Any


class Samples(NamedTuple):
  """Per sample ``[D * S]``: its token's place in its shard's T tokens, and the tokens it may
  sample in this call."""
  at: Any
  limit: Any


class SlotSampling(NamedTuple):
  """Per slot ``[B]``: its sampling stream, tokens sampled so far, temperature and top-p."""
  streams: Any
  counters: Any
  temperature: Any
  top_p: Any


class StepInputs(NamedTuple):
  tokens: Tokens
  samples: Samples
  slots: SlotSampling
  base_key: Any


def input_shardings(rows, replicated) -> StepInputs:
  """``StepInputs``' shardings as one prefix tree: everything with the rows but the key."""
  return StepInputs(rows, rows, rows, replicated)


def call(graphdef, layout: tuple, max_steps: int, stop_ids: tuple, paged: bool, attend_len: int,
         decoding: Decoding, cache, inputs: StepInputs, steps: Steps | None = None):
  """One engine call. Static: ``layout`` (``attention.Rows``'s mesh, batch and KV-head axes),
  ``max_steps``, ``stop_ids``, ``paged`` (the cache is a ``PagedKVCache``), ``attend_len``.
  Returns ``((tokens [D * S, max_steps], logprobs [D * S, max_steps], taken [D * S], last [D * S]),
  cache)``: entries past a sample's last sampled token are 0; ``taken`` and ``last`` are each
  sample's count of sampled tokens and the last of them (``decode_loop.tokens_taken``).
  ``steps`` comes last: XLA assigns buffers in argument order, and the programs with steps keep
  the per-device memory they had when their arguments were listed one by one, these last."""
  params, noiser = decoding
  (index, tokens, positions, valid, offsets), (sample_at, limit) = inputs.tokens, inputs.samples
  base_key = inputs.base_key
  if steps is not None:
    noiser = noiser.with_steps(steps.factors, steps.rows)
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
  streams, counters, temperature, top_p = (rows.take(x) for x in inputs.slots)
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

"""A ragged token batch through the cached forward (``qwen2.Options(token_offsets=)``): tokens of
several rows, prefill chunks and decode tokens mixed, laid out flat as width-1 batch rows that
may share a cache row, give the logits and cache of the per-row ``[B, T]`` call, and attention
reads key blocks up to the furthest token only (``attention.blockwise(keys_needed=)``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_models import tiny_model
from jaxes.models import attention, qwen2
from jaxes.models.attention import softmax


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64)


def _padded_call(model, cache, chunks):
  """The per-row call: row b feeds ``chunks[b]`` (padded to the longest)."""
  cfg, graphdef, params = model
  width = max(len(c) for c in chunks)
  tokens = np.zeros((len(chunks), width), np.int32)
  valid = np.zeros((len(chunks), width), bool)
  for b, c in enumerate(chunks):
    tokens[b, :len(c)], valid[b, :len(c)] = c, True
  positions = np.asarray(cache.index)[:, None] + np.arange(width)[None]
  logits, cache = qwen2.forward(graphdef, params, tokens, positions, valid, cache=cache)
  return [np.asarray(logits[b, :len(c)]) for b, c in enumerate(chunks)], cache


def _ragged_call(model, cache, chunks, pad=3):
  """The same tokens flat: one width-1 batch row per token (``pad`` padding tokens after)."""
  cfg, graphdef, params = model
  index, tokens, offsets = [], [], []
  for b, c in enumerate(chunks):
    index += [b] * len(c)
    tokens += list(c)
    offsets += list(range(len(c)))
  n = len(tokens)
  index, tokens, offsets = (np.asarray(x + [0] * pad, np.int32) for x in (index, tokens, offsets))
  valid = np.arange(n + pad) < n
  positions = np.asarray(cache.index)[index] + offsets
  logits, cache = qwen2.forward(graphdef, params, tokens[:, None], positions[:, None],
                                valid[:, None], cache=cache, options=qwen2.Options(
                                    access=attention.Rows(index), token_offsets=offsets[:, None]))
  out, start = [], 0
  for c in chunks:
    out.append(np.asarray(logits[start:start + len(c), 0]))
    start += len(c)
  return out, cache


def test_a_ragged_batch_gives_the_padded_calls_logits_and_cache(model, monkeypatch):
  monkeypatch.setattr(softmax, "KV_BLOCK", 4)   # several key blocks, most of them skipped
  cfg = model[0]
  rng = np.random.default_rng(0)
  padded = ragged = qwen2.KVCache.init(cfg, 3, 32)
  # A prefill of every row, then ragged steps: a decode token beside a chunk, a row left out.
  schedule = [[rng.integers(4, 64, size=n) for n in (5, 2, 7)],
              [rng.integers(4, 64, size=n) for n in (1, 6, 1)],
              [rng.integers(4, 64, size=n) for n in (1, 1, 3)]]
  for chunks in schedule:
    want, padded = _padded_call(model, padded, chunks)
    got, ragged = _ragged_call(model, ragged, chunks)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(ragged.index), np.asarray(padded.index))
    np.testing.assert_array_equal(np.asarray(ragged.valid), np.asarray(padded.valid))
    np.testing.assert_allclose(np.asarray(ragged.keys()), np.asarray(padded.keys()), atol=2e-6)


def test_bounded_blockwise_equals_the_whole_span():
  rng = np.random.default_rng(1)
  B, T, K, G, hd, S = 2, 3, 2, 2, 8, 32
  q = jnp.asarray(rng.normal(size=(B, T, K, G, hd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, hd)), jnp.float32) for _ in range(2))
  q_slots = jnp.asarray([[3, 4, 5], [9, 10, 11]], jnp.int32)

  def read(start, n):
    return (jax.lax.dynamic_slice_in_dim(k, start, n, axis=1),
            jax.lax.dynamic_slice_in_dim(v, start, n, axis=1))

  def visible(start, n):
    return (start + jnp.arange(n))[None, None, :] <= q_slots[:, :, None]

  whole = attention.blockwise(q, read, visible, S, block=4)
  bounded = jax.jit(lambda need: attention.blockwise(q, read, visible, S, block=4,
                                                     keys_needed=need))
  np.testing.assert_array_equal(np.asarray(bounded(q_slots.max() + 1)), np.asarray(whole))
  # Too few blocks is visibly wrong: the bound is what decides which keys are read.
  assert not np.allclose(np.asarray(bounded(jnp.int32(4))), np.asarray(whole), atol=1e-3)

"""Qwen2 decoder: parity with transformers, KV-cache decode == full forward, noiser coverage."""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxes.models import hf, qwen2
from jaxes.models.noiser import IdentityNoiser
from helpers_models import hf_logits, save_random_hf_checkpoint, tiny_model

PARITY_CONFIGS = {
  "tied-mha-odd": qwen2.Qwen2Config(vocab_size=97, hidden_size=40, intermediate_size=56,
                                    num_layers=2, num_heads=5, num_kv_heads=5, rope_theta=1e6,
                                    tie_word_embeddings=True),
  "untied-gqa3": qwen2.Qwen2Config(vocab_size=101, hidden_size=48, intermediate_size=72,
                                   num_layers=3, num_heads=6, num_kv_heads=2, rope_theta=1e4,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False),
  "tied-mqa-headdim": qwen2.Qwen2Config(vocab_size=64, hidden_size=36, intermediate_size=50,
                                        num_layers=2, num_heads=4, num_kv_heads=1, head_dim=10,
                                        tie_word_embeddings=True),
  # The Llama family: no q/k/v biases (SmolLM2's shape in small), and with them.
  "llama-tied-gqa3": qwen2.Qwen2Config(vocab_size=90, hidden_size=48, intermediate_size=64,
                                       num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=1e5,
                                       rms_norm_eps=1e-5, tie_word_embeddings=True,
                                       architecture="LlamaForCausalLM", attention_bias=False),
  "llama-untied-bias": qwen2.Qwen2Config(vocab_size=70, hidden_size=32, intermediate_size=40,
                                         num_layers=2, num_heads=4, num_kv_heads=4, head_dim=12,
                                         tie_word_embeddings=False, architecture="LlamaForCausalLM",
                                         attention_bias=True),
}

forward = jax.jit(qwen2.forward, static_argnums=0)


@pytest.fixture(scope="module", params=sorted(PARITY_CONFIGS))
def checkpoint(request, tmp_path_factory):
  cfg = PARITY_CONFIGS[request.param]
  path = str(tmp_path_factory.mktemp(request.param))
  torch_model = save_random_hf_checkpoint(path, cfg, seed=len(request.param))
  loaded_cfg, graphdef, params = hf.load(path)
  assert loaded_cfg == cfg
  return cfg, torch_model, graphdef, params


def test_logits_match_transformers(checkpoint):
  cfg, torch_model, graphdef, params = checkpoint
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 11))
  positions = np.tile(np.arange(11), (2, 1))
  ours, cache = forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions),
                        jnp.ones((2, 11), bool))
  assert cache is None and ours.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(ours), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_left_padding_matches_transformers(checkpoint):
  cfg, torch_model, graphdef, params = checkpoint
  rng = np.random.RandomState(2)
  lengths = [9, 4, 6]
  T = max(lengths)
  tokens = rng.randint(0, cfg.vocab_size, (3, T))
  valid = np.arange(T)[None, :] >= (T - np.array(lengths))[:, None]
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  ours, _ = forward(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions),
                    jnp.asarray(valid))
  for row, n in enumerate(lengths):  # each row alone, unpadded, through transformers
    ref = hf_logits(torch_model, tokens[row:row + 1, T - n:])[0]
    np.testing.assert_allclose(np.asarray(ours)[row, T - n:], ref, atol=1e-4, rtol=0)


def test_cached_decode_equals_full_forward_ragged():
  cfg, graphdef, params = tiny_model(vocab_size=61)
  rng = np.random.RandomState(3)
  lengths = [7, 12, 3, 0]  # the last row never receives a token
  seqs = [rng.randint(0, cfg.vocab_size, n) for n in lengths]
  reference = [np.asarray(forward(graphdef, params, jnp.asarray(s[None]),
                                  jnp.arange(len(s))[None], jnp.ones((1, len(s)), bool))[0][0])
               if len(s) else None for s in seqs]

  # Feed each row in chunks of random sizes at random places inside a step of width T; rows
  # with nothing left get an all-False step (must leave their cache row untouched).
  B, T, S = len(seqs), 5, 16
  cache = qwen2.KVCache.init(cfg, B, S)
  fed = [0] * B
  step = jax.jit(qwen2.forward, static_argnums=0)
  while any(f < n for f, n in zip(fed, lengths)):
    tokens = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    valid = np.zeros((B, T), bool)
    for b in range(B):
      n = min(rng.randint(0, T + 1), lengths[b] - fed[b])
      cols = np.sort(rng.choice(T, n, replace=False))
      tokens[b, cols] = seqs[b][fed[b]:fed[b] + n]
      positions[b, cols] = np.arange(fed[b], fed[b] + n)
      valid[b, cols] = True
    before = jax.tree.map(np.asarray, cache)
    logits, cache = step(graphdef, params, jnp.asarray(tokens), jnp.asarray(positions),
                         jnp.asarray(valid), cache)
    for b in range(B):
      n = int(valid[b].sum())
      if n:
        np.testing.assert_allclose(np.asarray(logits)[b, valid[b]],
                                   reference[b][fed[b]:fed[b] + n], atol=1e-5, rtol=0)
      else:
        for field in ("k", "v"):
          np.testing.assert_array_equal(np.asarray(getattr(cache, field))[:, b],
                                        getattr(before, field)[:, b])
      fed[b] += n
  np.testing.assert_array_equal(np.asarray(cache.index), lengths)
  np.testing.assert_array_equal(np.asarray(cache.valid), np.arange(S)[None] < np.array(lengths)[:, None])


def test_logits_at_and_attend_len_change_no_logits():
  cfg, graphdef, params = tiny_model(vocab_size=61)
  rng = np.random.RandomState(5)
  B, T = 3, 6
  tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (B, T)))
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  valid = jnp.asarray(np.arange(T)[None] < np.array([6, 2, 4])[:, None])
  at = jnp.asarray([5, 1, 3])
  for cache in (None, qwen2.KVCache.init(cfg, B, 8)):
    full, _ = forward(graphdef, params, tokens, positions, valid, cache)
    picked, _ = forward(graphdef, params, tokens, positions, valid, cache,
                        options=qwen2.Options(logits_at=at))
    assert picked.shape == (B, cfg.vocab_size)
    np.testing.assert_allclose(picked, np.asarray(full)[np.arange(B), at], atol=1e-6, rtol=0)
  # Attention bounded to the first T of the cache's 8 slots (all rows fit): the same logits.
  cache = qwen2.KVCache.init(cfg, B, 8)
  short, short_cache = forward(graphdef, params, tokens, positions, valid, cache,
                                     options=qwen2.Options(attend_len=T))
  np.testing.assert_allclose(short, full, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(short_cache.valid), np.asarray(_.valid))


def test_bfloat16_close_to_float32():
  cfg, graphdef, params = tiny_model(seed=1)
  bf_cfg = qwen2.Qwen2Config.preset("tiny-gqa", param_dtype="bfloat16", dtype="bfloat16")
  bf_graphdef, bf_params = nnx.split(qwen2.Qwen2ForCausalLM(bf_cfg, rngs=nnx.Rngs(1)), nnx.Param)
  nnx.replace_by_pure_dict(bf_params, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                   nnx.to_pure_dict(params)))
  tokens = jnp.asarray(np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 9)))
  positions, valid = jnp.tile(jnp.arange(9), (2, 1)), jnp.ones((2, 9), bool)
  full = forward(graphdef, params, tokens, positions, valid)[0]
  half = forward(bf_graphdef, bf_params, tokens, positions, valid)[0]
  assert half.dtype == jnp.float32
  assert jax.tree.leaves(bf_params)[0].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(half), np.asarray(full), atol=0.05 * float(jnp.abs(full).max()))


class RecordingNoiser(IdentityNoiser):
  """Identity noiser that records (at trace time) which parameter names reach which hook."""

  def __init__(self):
    self.calls = []

  def dense(self, x, kernel, bias, *, name, layer=None, bias_name=None):
    self.calls.append(("dense", name, layer is not None))
    if bias_name is not None:
      self.calls.append(("dense-bias", bias_name, layer is not None))
    return super().dense(x, kernel, bias, name=name, layer=layer, bias_name=bias_name)

  def embed(self, table, ids, *, name):
    self.calls.append(("embed", name, False))
    return super().embed(table, ids, name=name)

  def attend(self, x, table, *, name):
    self.calls.append(("attend", name, False))
    return super().attend(x, table, name=name)

  def scale(self, x, scale, *, name, layer=None):
    self.calls.append(("scale", name, layer is not None))
    return super().scale(x, scale, name=name, layer=layer)


@pytest.mark.parametrize("tied, llama", [(True, False), (False, False), (True, True)])
def test_every_parameter_goes_through_the_noiser(tied, llama):
  cfg = qwen2.Qwen2Config.preset("tiny", tie_word_embeddings=tied, **(
      dict(architecture="LlamaForCausalLM", attention_bias=False) if llama else {}))
  model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
  noiser = RecordingNoiser()
  tokens = jnp.zeros((1, 3), jnp.int32)
  model(tokens, jnp.arange(3)[None], jnp.ones((1, 3), bool), noiser=noiser)
  paths = {"/".join(str(k.key) for k in path) for path, _ in
           jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}
  assert {name for _, name, _ in noiser.calls} == paths
  assert any(p.endswith("/bias") for p in paths) != llama   # no bias leaf to perturb without one
  for kind, name, has_layer in noiser.calls:  # stacked params get the layer index, others not
    assert has_layer == name.startswith("layers/"), (kind, name)
  if tied:
    assert ("attend", "embed/embedding", False) in noiser.calls


def test_presets_have_published_shapes():
  seven = qwen2.Qwen2Config.preset("qwen2.5-7b")
  assert (seven.hidden_size, seven.num_layers, seven.num_heads, seven.num_kv_heads,
          seven.intermediate_size, seven.vocab_size, seven.head_size,
          seven.tie_word_embeddings) == (3584, 28, 28, 4, 18944, 152064, 128, False)
  half = qwen2.Qwen2Config.preset("qwen2.5-0.5b")
  assert (half.hidden_size, half.num_layers, half.num_heads, half.num_kv_heads, half.head_size,
          half.tie_word_embeddings) == (896, 24, 14, 2, 64, True)
  with pytest.raises(ValueError, match="unknown Qwen2 preset 'qwen3'"):
    qwen2.Qwen2Config.preset("qwen3")
  resized = dataclasses.replace(qwen2.Qwen2Config.preset("tiny"), hidden_size=32)
  assert resized.head_size == 8  # derived again, not carried over from the preset
  with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
    qwen2.Qwen2Config.preset("tiny", num_heads=6, num_kv_heads=4, head_dim=16)


def test_blockwise_attention_equals_dense_softmax_float32():
  """The cached path's online softmax over key blocks gives the one-softmax logits (float32)."""
  from jaxes.models import attention
  rng = np.random.RandomState(7)
  L, B, T, S, K, G, hd = 2, 3, 5, 24, 2, 3, 8
  q = jnp.asarray(rng.randn(B, T, K, G, hd), jnp.float32)
  cache_k = jnp.asarray(rng.randn(L, B, S, K, hd), jnp.float32)
  cache_v = jnp.asarray(rng.randn(L, B, S, K, hd), jnp.float32)
  index = np.array([0, 7, 15])
  valid = jnp.asarray(np.arange(S)[None] < (index + T)[:, None])
  slots = jnp.asarray(index[:, None] + np.arange(T)[None])
  slots = slots.at[2, 3:].set(S)  # row 2's last queries are padding: they see every valid key
  layer = jnp.int32(1)

  def attend(q, cache_k, cache_v, layer, addressing):   # values, not raw bits: no dtype
    return attention.layer_cache(cache_k, cache_v, attention.Dense(), addressing).attend(q, layer)

  for span, block in ((24, 4), (24, 7), (16, 8), (24, 512)):  # 7 -> blocks of 6 (a divisor)
    out = attend(q, cache_k, cache_v, layer, attention.Addressing(valid, slots, span=span, block=block))
    mask = valid[:, None, :span] & (jnp.arange(span)[None, None] <= slots[:, :, None])
    ref = attention.dense(q, cache_k[1, :, :span], cache_v[1, :, :span], mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=0)
  # A query that sees no key at all (all masked) averages the values, as the dense floor does.
  none = jnp.zeros((B, S), bool)
  out = attend(q, cache_k, cache_v, layer, attention.Addressing(none, slots, span=S, block=4))
  ref = attention.dense(q, cache_k[1], cache_v[1], jnp.zeros((B, T, S), bool))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6, rtol=0)

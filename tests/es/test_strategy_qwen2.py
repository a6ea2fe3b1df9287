"""ES noisers on the real (tiny) Qwen2 model: a population forward, including KV-cache prefill
and decode, equals a loop over members with explicitly materialised theta + sigma * eps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxes import es
from jaxes.models import qwen2


def _model(preset):
  cfg = qwen2.Qwen2Config.preset(preset, vocab_size=64, hidden_size=32, intermediate_size=48,
                                 max_position_embeddings=64)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  # Non-zero biases and non-unit norm gains, so their perturbation is exercised too.
  params = jax.tree_util.tree_map(lambda p: p + 0.05 * jnp.sin(jnp.arange(p.size).reshape(p.shape)),
                                  params)
  return cfg, graphdef, params


def _prefill_then_decode(graphdef, cfg, params, tokens, valid, noiser):
  """Left-padded prefill into a cache, then one decode step; returns both steps' logits."""
  B, T = tokens.shape
  cache = qwen2.KVCache.init(cfg, B, T + 1)
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
  logits, cache = qwen2.forward(graphdef, params, tokens, positions, valid, cache, noiser)
  next_tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
  step, _ = qwen2.forward(graphdef, params, next_tok, cache.index[:, None],
                          jnp.ones((B, 1), bool), cache, noiser)
  return logits, step


# Untied head (a dense op) in low-rank mode, tied head (attend) in full mode.
@pytest.mark.parametrize("mode, preset", [("lowrank", "tiny-gqa"), ("full", "tiny")])
def test_population_forward_equals_loop_over_materialised_members(mode, preset):
  cfg, graphdef, params = _model(preset)
  strategy = es.Strategy(population=4, sigma=0.05, learning_rate=0.1, mode=mode, rank=2)
  state = strategy.init(params, jax.random.key(11))
  names = {s.name: s.kind for s in strategy.leaf_specs(params)}
  assert names["layers/attn/q_proj/kernel"] == ("lowrank" if mode == "lowrank" else "full")
  assert names["layers/attn/q_proj/bias"] == "full" and names["final_norm/scale"] == "full"

  versions = jnp.array([0, 0, 0], jnp.int32)
  members = jnp.array([3, -1, 0], jnp.int32)
  row_group = jnp.array([2, 0, 1, 0], jnp.int32)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(4, 6)), jnp.int32)
  valid = jnp.asarray(np.arange(6)[None, :] >= np.array([0, 2, 1, 3])[:, None])  # left padding

  @jax.jit
  def population(params, versions, members, row_group, tokens, valid):
    noiser = strategy.member_noiser(params, versions, members, row_group, run_key=state.run_key)
    return _prefill_then_decode(graphdef, cfg, params, tokens, valid, noiser)

  single = jax.jit(lambda p, t, v: _prefill_then_decode(graphdef, cfg, p, t, v, None))
  got = [np.asarray(x) for x in population(params, versions, members, row_group, tokens, valid)]
  for b, g in enumerate(np.asarray(row_group)):
    theta = strategy.perturbed(state, (int(versions[g]), int(members[g])))
    want = single(theta, tokens[b:b + 1], valid[b:b + 1])
    for got_x, want_x in zip(got, want):
      rows = np.asarray(valid[b]) if got_x.shape[1] == tokens.shape[1] else slice(None)
      np.testing.assert_allclose(got_x[b][rows], np.asarray(want_x)[0][rows], rtol=2e-4, atol=2e-5)
  unperturbed = single(params, tokens[:1], valid[:1])[1]  # row 0 is member 0: visibly perturbed
  assert not np.allclose(got[1][0], np.asarray(unperturbed)[0], atol=1e-4)

"""Population forward through the ES noiser equals a loop over members with materialised
theta + sigma * eps: on a toy model that uses every op of the hook, and on the real tiny Qwen2."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes import es
from jaxes.models.noiser import IdentityNoiser

VOCAB, D, H, L = 11, 6, 5, 3


def toy_params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s) * 0.5, dtype)
  return {
      "embed": {"embedding": f(VOCAB, D)},
      "layers": {"norm": {"scale": f(L, D)}, "up": {"kernel": f(L, D, H), "bias": f(L, H)},
                 "down": {"kernel": f(L, H, D)}},
      "final_norm": {"scale": f(D)},
      "head": {"kernel": f(D, VOCAB)},
  }


def toy_forward(params, ids, noiser):
  x = noiser.embed(params["embed"]["embedding"], ids, name="embed/embedding")

  def layer(x, scanned):
    lp, l = scanned
    h = noiser.scale(x, lp["norm"]["scale"], name="layers/norm/scale", layer=l)
    h = noiser.dense(h, lp["up"]["kernel"], lp["up"]["bias"], name="layers/up/kernel", layer=l,
                     bias_name="layers/up/bias")
    h = noiser.dense(jnp.tanh(h), lp["down"]["kernel"], None, name="layers/down/kernel", layer=l)
    return x + h, None

  x, _ = jax.lax.scan(layer, x, (params["layers"], jnp.arange(L)))
  x = noiser.scale(x, params["final_norm"]["scale"], name="final_norm/scale")
  tied = noiser.attend(x, params["embed"]["embedding"], name="embed/embedding")
  untied = noiser.dense(x, params["head"]["kernel"], None, name="head/kernel")
  return tied + untied


def _loop_reference(strategy, state, versions, members, row_group, run):
  """Row b computed with member (versions[g], members[g]) materialised, g = row_group[b]."""
  rows = []
  for b, g in enumerate(row_group):
    theta = strategy.perturbed(state, (int(versions[g]), int(members[g])))
    rows.append(run(theta, b))
  return np.stack(rows)


def test_toy_population_forward_equals_loop_over_materialised_members():
  # Low-rank with frozen vectors here; tests/es/test_strategy_qwen2.py covers noisy vectors and full mode.
  strategy = es.Strategy(population=6, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2,
                         sigma_schedule="cosine", sigma_final=0.1, schedule_steps=4,
                         perturb_vectors=False)
  params = toy_params()
  state = strategy.init(params, jax.random.key(3))
  state = es.ESState(params, state.opt_state, state.key, 2)  # version 2, base params unchanged
  versions = np.array([2, 0, 1, 2], np.int32)   # stale groups use their own key and sigma
  members = np.array([1, 4, 0, -1], np.int32)   # -1: unperturbed rows
  row_group = np.array([0, 1, 1, 2, 3, 0, 2], np.int32)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(7, 5)), jnp.int32)

  @jax.jit
  def population(params, versions, members, row_group, ids):
    noiser = strategy.member_noiser(params, versions, members, row_group, run_key=state.run_key)
    return toy_forward(params, ids, noiser)

  got = np.asarray(population(params, versions, members, row_group, ids))
  single = jax.jit(lambda p, i: toy_forward(p, i, IdentityNoiser()))
  want = _loop_reference(strategy, state, versions, members, row_group,
                         lambda theta, b: np.asarray(single(theta, ids[b:b + 1]))[0])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  unperturbed = np.asarray(single(params, ids[4:5]))[0]
  np.testing.assert_allclose(got[4], unperturbed, rtol=1e-6, atol=1e-6)
  assert not np.allclose(got[0], unperturbed, atol=1e-3)
  theta = strategy.perturbed(state, (2, 1))
  np.testing.assert_array_equal(theta["layers"]["up"]["bias"], params["layers"]["up"]["bias"])
  np.testing.assert_array_equal(theta["final_norm"]["scale"], params["final_norm"]["scale"])


def test_noiser_rejects_unknown_names_and_wrong_batch():
  strategy = es.Strategy(population=2, sigma=0.1, learning_rate=0.1, mode="lowrank")
  params = toy_params()
  state = strategy.init(params, jax.random.key(0))
  noiser = strategy.member_noiser(params, jnp.array([0]), jnp.array([0]), jnp.array([0, 0]),
                                  run_key=state.run_key)
  x = jnp.ones((2, D))
  with pytest.raises(KeyError, match="not/a/param"):
    noiser.dense(x, jnp.ones((D, D)), None, name="not/a/param")
  with pytest.raises(ValueError, match="stacked"):
    noiser.dense(x, jnp.ones((D, H)), None, name="layers/up/kernel")
  with pytest.raises(ValueError, match="rows"):
    noiser.dense(jnp.ones((3, D)), params["head"]["kernel"], None, name="head/kernel")

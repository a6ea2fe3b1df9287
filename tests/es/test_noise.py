"""Keys, noise generation, fitness shaping and sigma schedules of jaxes.es."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes import es
from jaxes.es import keys, noise, schedules, shaping

CFG_FULL = noise.NoiseConfig(mode="full")
CFG_LOW = noise.NoiseConfig(mode="lowrank", rank=2)


def _spec(name, shape, cfg=CFG_FULL):
  return noise.leaf_spec(name, shape, jnp.float32, cfg)


def _mkey(version=0, member=0, seed=0):
  return keys.member_key(jax.random.key(seed), version, member, antithetic=True)


def _corr(a, b):
  a, b = np.ravel(a), np.ravel(b)
  return float(np.corrcoef(a, b)[0, 1])


def test_param_name_from_nested_dict_and_nnx_state():
  from flax import nnx

  class M(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

  _, state = nnx.split(M(), nnx.Param)
  names = sorted(keys.param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0])
  assert names == ["lin/bias", "lin/kernel"]
  pure = state.to_pure_dict()
  assert sorted(keys.param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]) == names
  assert keys.param_name(jax.tree_util.tree_flatten_with_path([{"a": 1}])[0][0][0]) == "0/a"


def test_noise_deterministic_per_key_and_standard_normal():
  spec = _spec("layers/mlp/kernel", (2, 64, 32))
  a = noise.full_noise(_mkey(3, 4), spec)
  b = noise.full_noise(_mkey(3, 4), spec)
  np.testing.assert_array_equal(a, b)
  assert a.dtype == jnp.float32 and a.shape == (2, 64, 32)
  assert abs(float(a.mean())) < 0.05 and abs(float(a.std()) - 1) < 0.05
  assert not np.array_equal(a, noise.full_noise(_mkey(4, 4), spec))   # another version
  assert not np.array_equal(a, noise.full_noise(_mkey(3, 6), spec))   # another pair
  assert not np.array_equal(a, noise.full_noise(_mkey(3, 4, seed=1), spec))  # another run


def test_equal_shaped_leaves_and_layers_get_independent_noise():
  k = _mkey()
  q = noise.full_noise(k, _spec("layers/attn/q_proj/kernel", (3, 64, 64)))
  o = noise.full_noise(k, _spec("layers/attn/o_proj/kernel", (3, 64, 64)))
  assert abs(_corr(q, o)) < 0.05
  for i in range(3):
    for j in range(i + 1, 3):
      assert abs(_corr(q[i], q[j])) < 0.1
  lq = noise.lowrank_factors(k, _spec("layers/q/kernel", (3, 64, 48), CFG_LOW), 2)
  lo = noise.lowrank_factors(k, _spec("layers/o/kernel", (3, 64, 48), CFG_LOW), 2)
  assert abs(_corr(lq[0], lo[0])) < 0.1 and abs(_corr(lq[0][0], lq[0][1])) < 0.2


def test_noise_depends_on_the_leaf_path_not_its_position():
  k = _mkey()
  spec = _spec("b/kernel", (8, 8))
  params_small = {"b": {"kernel": jnp.zeros((8, 8))}}
  params_big = {"a": {"kernel": jnp.zeros((8, 8))}, "b": {"kernel": jnp.zeros((8, 8))}}
  small = {s.name: s for s in noise.plan(params_small, CFG_FULL)}
  big = {s.name: s for s in noise.plan(params_big, CFG_FULL)}
  np.testing.assert_array_equal(noise.full_noise(k, small["b/kernel"]), noise.full_noise(k, spec))
  np.testing.assert_array_equal(noise.full_noise(k, big["b/kernel"]), noise.full_noise(k, spec))


def test_stacked_layer_slice_matches_per_layer_key():
  spec = _spec("layers/w", (4, 5, 6))
  k = _mkey(1, 2)
  stacked = noise.full_noise(k, spec)
  for layer in range(4):
    direct = jax.random.normal(keys.leaf_key(k, "layers/w", layer), (5, 6), jnp.float32)
    np.testing.assert_array_equal(stacked[layer], direct)


def test_antithetic_members_share_key_and_flip_sign():
  rk = jax.random.key(0)
  np.testing.assert_array_equal(jax.random.key_data(keys.member_key(rk, 2, 6, True)),
                                jax.random.key_data(keys.member_key(rk, 2, 7, True)))
  assert float(keys.member_sign(6, True)) == 1.0 and float(keys.member_sign(7, True)) == -1.0
  assert float(keys.member_sign(7, False)) == 1.0
  assert not np.array_equal(jax.random.key_data(keys.member_key(rk, 2, 6, False)),
                            jax.random.key_data(keys.member_key(rk, 2, 7, False)))


def test_leaf_kinds_per_mode():
  params = {"layers": {"k": jnp.zeros((2, 3, 4)), "b": jnp.zeros((2, 4))}, "e": jnp.zeros((5, 3)),
            "s": jnp.zeros(()), "t": jnp.zeros((2, 3, 4))}
  kinds = lambda cfg: {s.name: (s.kind, s.stacked) for s in noise.plan(params, cfg)}
  assert kinds(noise.NoiseConfig(mode="full")) == {
      "layers/k": ("full", True), "layers/b": ("full", True), "e": ("full", False),
      "s": ("full", False), "t": ("full", False)}
  assert kinds(noise.NoiseConfig(mode="lowrank", perturb_vectors=False)) == {
      "layers/k": ("lowrank", True), "layers/b": ("frozen", True), "e": ("lowrank", False),
      "s": ("frozen", False), "t": ("full", False)}


def test_frozen_patterns_leave_leaves_unperturbed_and_unchanged():
  params = {"layers": {"kernel": jnp.ones((2, 3, 4)), "bias": jnp.ones((2, 4))},
            "embedding": jnp.ones((5, 3)), "scale": jnp.ones(3)}
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.5, mode="lowrank",
                         frozen=["kernel$", "^embedding"])
  assert {s.name: s.kind for s in strategy.leaf_specs(params)} == {
      "layers/kernel": "frozen", "layers/bias": "full", "embedding": "frozen", "scale": "full"}
  state = strategy.init(params, jax.random.key(0))
  member = strategy.perturbed(state, strategy.members(state)[0])
  np.testing.assert_array_equal(member["layers"]["kernel"], params["layers"]["kernel"])
  assert not np.array_equal(member["scale"], params["scale"])
  state, _ = strategy.update(state, [(v, m, float(m)) for v, m in strategy.members(state)])
  np.testing.assert_array_equal(state.params["embedding"], params["embedding"])
  np.testing.assert_array_equal(state.params["layers"]["kernel"], params["layers"]["kernel"])
  assert not np.array_equal(state.params["layers"]["bias"], params["layers"]["bias"])


def test_lowrank_noise_has_unit_variance_entries():
  spec = _spec("w", (128, 96), noise.NoiseConfig(mode="lowrank", rank=4))
  eps = np.stack([noise.leaf_noise(_mkey(0, 2 * j), spec, 4) for j in range(8)])
  assert abs(eps.var() - 1) < 0.15


def test_zscore_and_centered_rank():
  f = np.array([3.0, 1.0, 2.0, 2.0])
  np.testing.assert_allclose(shaping.zscore(f), (f - f.mean()) / (f.std() + 1e-8))
  np.testing.assert_allclose(shaping.centered_rank(f), [0.5, -0.5, 0.0, 0.0])
  np.testing.assert_allclose(shaping.centered_rank(np.array([5.0, -1.0, 7.0])), [0.0, -0.5, 0.5])
  for fn in (shaping.zscore, shaping.centered_rank):
    np.testing.assert_array_equal(fn(np.full(6, 0.25)), np.zeros(6))
  with pytest.raises(ValueError, match="shaping"):
    shaping.shape(f, "rank")


def test_sigma_schedules():
  assert schedules.sigma_at(7, "constant", 0.1) == 0.1
  cos = lambda v: schedules.sigma_at(v, "cosine", 1e-3, 2.5e-4, 100)
  assert cos(0) == pytest.approx(1e-3) and cos(50) == pytest.approx(6.25e-4)
  assert cos(100) == pytest.approx(2.5e-4) and cos(250) == pytest.approx(2.5e-4)
  traced = jax.jit(lambda v: schedules.sigma_at(v, "cosine", 1e-3, 2.5e-4, 100))(jnp.array([0, 50, 300]))
  np.testing.assert_allclose(traced, [cos(0), cos(50), cos(300)], rtol=1e-6)
  with pytest.raises(ValueError, match="sigma_final"):
    schedules.validate("cosine", 1e-3, None, 100)
  with pytest.raises(ValueError, match="schedule_steps"):
    schedules.validate("cosine", 1e-3, 1e-4, None)


@pytest.mark.parametrize("kwargs, key", [
    (dict(population=7), "population"), (dict(mode="dense"), "mode"), (dict(rank=0), "rank"),
    (dict(shaping="rank"), "shaping"), (dict(sigma=0.0), "sigma"), (dict(optimizer="sgdm"), "optimizer"),
    (dict(nonfinite="skip"), "nonfinite"), (dict(staleness_weighting=2.0), "staleness_weighting"),
    (dict(sigma_schedule="cosine", schedule_steps=10), "sigma_final"),
    (dict(frozen=["kernel("]), "frozen"),
])
def test_strategy_rejects_bad_config_naming_the_key(kwargs, key):
  base = dict(population=8, sigma=0.1, learning_rate=0.1)
  with pytest.raises(ValueError, match=key):
    es.Strategy(**{**base, **kwargs})

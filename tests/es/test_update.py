"""The ES update against a NumPy reference built from the same keyed noise: full and low-rank,
fresh and stale results, sigma schedules, shaping, optimizers, dtypes, memory, failure modes."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxes import es
from jaxes.es import keys, noise, update


def _params(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return {"layers": {"w": jnp.asarray(rng.normal(size=(2, 6, 5)), dtype),
                     "b": jnp.asarray(rng.normal(size=(2, 5)), dtype)},
          "head": {"kernel": jnp.asarray(rng.normal(size=(5, 4)), dtype)},
          "gain": jnp.asarray(rng.normal(size=(4,)), dtype)}


_leaf_noise = jax.jit(noise.leaf_noise, static_argnums=(1, 2))


def _eps(strategy, state, version, member):
  """Noise of (version, member) for every leaf, float64, via the documented key derivation."""
  cfg = strategy.noise_config
  mkey = keys.member_key(state.run_key, version, member, cfg.antithetic)
  sign = float(keys.member_sign(member, cfg.antithetic))
  return [sign * np.asarray(_leaf_noise(mkey, spec, cfg.rank), np.float64)
          for spec in noise.plan(state.params, cfg)]


def _reference_direction(strategy, state, results, weights=None):
  """(1/N) sum_i w_i eps_i with w = zscore(f) * sigma_{v_i}/sigma_0 (numpy float64)."""
  f = np.array([r[2] for r in results], np.float64)
  z = (f - f.mean()) / (f.std() + 1e-8) if weights is None else weights
  leaves = [np.zeros(p.shape) for p in jax.tree_util.tree_leaves(state.params)]
  for (v, m, _), zi in zip(results, z):
    scale = zi * strategy.sigma_at(v) / strategy.sigma
    for acc, e in zip(leaves, _eps(strategy, state, v, m)):
      acc += scale * e
  return [acc / len(results) for acc in leaves]


def _leaves64(tree):
  return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def _random_results(state, members, seed):
  rng = np.random.default_rng(seed)
  return [(v, m, float(rng.normal())) for v, m in members]


@pytest.mark.parametrize("mode", ["full", "lowrank"])
def test_update_equals_numpy_reference(mode):
  strategy = es.Strategy(population=8, sigma=0.1, learning_rate=0.3, mode=mode, rank=3,
                         weight_decay=0.01)
  state = strategy.init(_params(), jax.random.key(1))
  results = _random_results(state, strategy.members(state), 0)
  new, metrics = strategy.update(state, results)
  direction = _reference_direction(strategy, state, results)
  for got, theta, d in zip(_leaves64(new.params), _leaves64(state.params), direction):
    want = theta + 0.3 * (d - 0.01 * theta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert metrics["version"] == 1 and new.version == 1 and metrics["num_results"] == 8
  assert not metrics["zero_step"] and metrics["update_norm"] > 0
  change = math.sqrt(sum(np.sum((g - t) ** 2) for g, t in zip(_leaves64(new.params), _leaves64(state.params))))
  assert metrics["update_norm"] == pytest.approx(change, rel=1e-4)


def test_update_with_cohort_is_update_and_the_cohort_it_stepped_along():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.3, mode="lowrank", rank=2)
  state = strategy.init(_params(), jax.random.key(2))
  results = _random_results(state, strategy.members(state), 5)
  new, metrics, cohort = strategy.update_with_cohort(state, results)
  plain, plain_metrics = strategy.update(state, results)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert metrics == plain_metrics and int(new.version) == 1
  for a, b in zip(cohort, strategy.cohort(state, results), strict=True):
    np.testing.assert_array_equal(a, b)


def test_lowrank_update_moves_matrices_along_rank_r_directions():
  strategy = es.Strategy(population=2, sigma=0.1, learning_rate=1.0, mode="lowrank", rank=1)
  state = strategy.init(_params(), jax.random.key(0))
  new, _ = strategy.update(state, [(0, 0, 1.0), (0, 1, 0.0)])  # one antithetic pair: rank-1 step
  step = np.asarray(new.params["head"]["kernel"]) - np.asarray(state.params["head"]["kernel"])
  s = np.linalg.svd(step, compute_uv=False)
  assert s[0] > 0 and s[1] < 1e-5 * s[0]


def test_stale_results_use_their_own_version_noise_and_sigma():
  strategy = es.Strategy(population=4, sigma=0.2, learning_rate=0.1, sigma_schedule="cosine",
                         sigma_final=0.05, schedule_steps=3)
  state = strategy.init(_params(), jax.random.key(2))
  for _ in range(2):  # advance to version 2
    state, _ = strategy.update(state, _random_results(state, strategy.members(state), 1))
  assert state.version == 2
  results = [(0, 1, 0.3), (1, 2, -1.0), (2, 0, 0.7), (2, 3, 2.0), (0, 2, -0.4)]
  new, metrics = strategy.update(state, results)
  want = [t + 0.1 * d for t, d in zip(_leaves64(state.params),
                                      _reference_direction(strategy, state, results))]
  for got, w in zip(_leaves64(new.params), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  assert metrics["staleness_hist"] == [2, 1, 2] and metrics["staleness_max"] == 2
  assert metrics["staleness_mean"] == pytest.approx(1.0)
  assert metrics["sigma"] == pytest.approx(strategy.sigma_at(3))
  # Treating them all as fresh (current version's keys) would give a different step.
  fresh = [(2, m, f) for _, m, f in results[:4]]
  wrong, _ = strategy.update(state, fresh)
  assert not np.allclose(_leaves64(wrong.params)[0], _leaves64(new.params)[0])


def test_staleness_weighting_and_centered_rank():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, shaping="centered_rank",
                         staleness_weighting=0.5)
  state = strategy.init(_params(), jax.random.key(3))
  state = es.ESState(state.params, state.opt_state, state.key, 2)
  results = [(2, 0, 1.0), (1, 1, 3.0), (0, 2, 2.0)]
  new, _ = strategy.update(state, results)
  weights = np.array([-0.5, 0.5, 0.0]) * np.array([1.0, 0.5, 0.25])
  want = [t + 0.1 * d for t, d in zip(_leaves64(state.params),
                                      _reference_direction(strategy, state, results, weights))]
  for got, w in zip(_leaves64(new.params), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_adamw_first_step_matches_reference():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, optimizer="adam",
                         weight_decay=0.1)
  state = strategy.init(_params(), jax.random.key(4))
  results = _random_results(state, strategy.members(state), 2)
  new, _ = strategy.update(state, results)
  for got, theta, d in zip(_leaves64(new.params), _leaves64(state.params),
                           _reference_direction(strategy, state, results)):
    want = theta + 0.1 * (d / (np.abs(d) + 1e-8) - 0.1 * theta)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_all_equal_fitness_gives_zero_step(optimizer):
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, optimizer=optimizer,
                         weight_decay=0.1 if optimizer == "adam" else 0.0)
  state = strategy.init(_params(), jax.random.key(5))
  state, _ = strategy.update(state, _random_results(state, strategy.members(state), 3))
  new, metrics = strategy.update(state, [(v, m, 0.5) for v, m in strategy.members(state)])
  for got, before in zip(_leaves64(new.params), _leaves64(state.params)):
    np.testing.assert_array_equal(got, before)
  assert metrics["zero_step"] and metrics["update_norm"] == 0.0 and new.version == 2
  empty, metrics = strategy.update(new, [])
  assert metrics["zero_step"] and metrics["num_results"] == 0 and empty.version == 3


@pytest.mark.parametrize("mode", ["full", "lowrank"])
def test_bfloat16_params_stay_bfloat16_with_float32_accumulation(mode):
  strategy = es.Strategy(population=4, sigma=0.05, learning_rate=0.1, mode=mode)
  params = _params(jnp.bfloat16)
  state = strategy.init(params, jax.random.key(6))
  theta = strategy.perturbed(state, (0, 1))
  results = _random_results(state, strategy.members(state), 4)
  new, _ = strategy.update(state, results)
  for tree in (theta, new.params):
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(params)
    for got, p in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(params)):
      assert got.dtype == jnp.bfloat16 and got.shape == p.shape
  # The step is accumulated in float32 and rounded once, so it lands within one bfloat16 step
  # of the exact result; the raw step (~1e-2) is far above bfloat16 resolution near 1e-3.
  for got, theta64, d in zip(_leaves64(new.params), _leaves64(state.params),
                             _reference_direction(strategy, state, results)):
    want = theta64 + 0.1 * d
    ulp = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)) * 2.0 ** -7
    assert np.all(np.abs(got - want) <= ulp + 1e-6)
    assert np.any(got != theta64)
  adam = es.Strategy(population=4, sigma=0.05, learning_rate=0.1, mode=mode, optimizer="adam")
  opt_leaves = jax.tree_util.tree_leaves(adam.init(params, jax.random.key(6)).opt_state)
  assert all(x.dtype == jnp.float32 for x in opt_leaves if jnp.issubdtype(x.dtype, jnp.floating))


@pytest.mark.parametrize("mode", ["full", "lowrank"])
def test_es_improves_a_black_box_objective(mode):
  rng = np.random.default_rng(7)
  target = {"w": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}
  loss = jax.jit(lambda p: sum(jnp.sum((p[k] - target[k]) ** 2) for k in p))
  strategy = es.Strategy(population=16, sigma=0.1, learning_rate=0.3, mode=mode, rank=2)
  state = strategy.init(jax.tree_util.tree_map(jnp.zeros_like, target), jax.random.key(0))
  start = float(loss(state.params))
  for _ in range(20):
    results = [(v, m, -float(loss(strategy.perturbed(state, (v, m)))))
               for v, m in strategy.members(state)]
    state, _ = strategy.update(state, results)
  assert float(loss(state.params)) < 0.25 * start


def test_full_update_memory_does_not_grow_with_population():
  params = {"w": jnp.zeros((256, 256)), "b": jnp.zeros((256,))}
  cfg = noise.NoiseConfig(mode="full")
  apply = jax.jit(functools.partial(update.apply, cfg=cfg, tx=optax.sgd(0.1)))
  theta_bytes = 4 * (256 * 256 + 256)
  temp = []
  for n in (4, 64):
    compiled = apply.lower(params, optax.sgd(0.1).init(params), jax.random.key(0),
                           jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                           jnp.ones(n, jnp.float32), jnp.int32(n)).compile()
    temp.append(compiled.memory_analysis().temp_size_in_bytes)
  assert temp[1] <= temp[0] + 64 * 1024
  assert temp[1] < 16 * theta_bytes


def test_bad_results_fail_with_clear_errors():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1)
  state = strategy.init(_params(), jax.random.key(0))
  with pytest.raises(ValueError, match=r"non-finite.*\(0, 2, nan\)"):
    strategy.update(state, [(0, 0, 1.0), (0, 2, float("nan"))])
  with pytest.raises(ValueError, match="version 1 is outside"):
    strategy.update(state, [(1, 0, 1.0)])
  with pytest.raises(ValueError, match="member -1 must be >= 0"):
    strategy.update(state, [(0, -1, 1.0)])
  with pytest.raises(ValueError, match="duplicate"):
    strategy.update(state, [(0, 1, 1.0), (0, 1, 2.0)])
  with pytest.raises(ValueError, match="result 0"):
    strategy.update(state, [(0, 1)])
  with pytest.raises(ValueError, match="version 3 is outside"):
    strategy.perturbed(state, (3, 0))


def test_nonfinite_fitness_is_excluded_and_counted():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, nonfinite="exclude")
  state = strategy.init(_params(), jax.random.key(0))
  results = [(0, 0, 1.0), (0, 1, float("inf")), (0, 2, -1.0), (0, 3, float("nan"))]
  new, metrics = strategy.update(state, results)
  clean, _ = strategy.update(state, [results[0], results[2]])
  assert metrics["excluded"] == 2 and metrics["num_results"] == 2
  for a, b in zip(_leaves64(new.params), _leaves64(clean.params)):
    np.testing.assert_array_equal(a, b)


def test_members_perturbed_and_antithetic_pairs():
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1)
  state = strategy.init(_params(), jax.random.key(0))
  assert strategy.members(state) == [(0, 0), (0, 1), (0, 2), (0, 3)]
  theta = _leaves64(state.params)
  plus, minus = (_leaves64(strategy.perturbed(state, (0, m))) for m in (2, 3))
  for t, p, m in zip(theta, plus, minus):
    np.testing.assert_allclose(p - t, -(m - t), atol=1e-6)
    assert np.abs(p - t).max() > 0
  assert strategy.perturbed(state, (0, -1)) is state.params


def test_update_and_perturbed_on_sharded_params_equal_unsharded():
  devices = np.array(jax.devices()[:8])
  if devices.size < 2:
    pytest.skip(f"needs >= 2 devices, have {devices.size} (set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = jax.sharding.Mesh(devices, ("fsdp",))
  rng = np.random.default_rng(9)
  params = {"layers": {"w": jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)},
            "embed": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)}
  spec = {"layers": {"w": jax.sharding.PartitionSpec(None, "fsdp", None)},
          "embed": jax.sharding.PartitionSpec("fsdp", None)}
  sharded = jax.device_put(params, jax.tree_util.tree_map(
      lambda s: jax.sharding.NamedSharding(mesh, s), spec))
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1)
  plain, dist = strategy.init(params, jax.random.key(0)), strategy.init(sharded, jax.random.key(0))
  results = [(0, 0, 1.0), (0, 1, -0.5), (0, 3, 2.0)]
  for a, b in zip(_leaves64(strategy.update(plain, results)[0].params),
                  _leaves64(strategy.update(dist, results)[0].params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  for a, b in zip(_leaves64(strategy.perturbed(plain, (0, 3))), _leaves64(strategy.perturbed(dist, (0, 3)))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_member_ids_beyond_population_are_their_own_members():
  # An async controller issues ids past `population` (fresh members of the newest version).
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1)
  state = strategy.init(_params(), jax.random.key(0))
  a, b = strategy.perturbed(state, (0, 2)), strategy.perturbed(state, (0, 6))
  assert not np.allclose(jax.tree.leaves(a)[0], jax.tree.leaves(b)[0])
  new, metrics = strategy.update(state, [(0, 4, 1.0), (0, 5, 0.0), (0, 6, 2.0), (0, 7, -1.0)])
  assert metrics["num_results"] == 4 and not metrics["zero_step"]


def test_options_as_objects_equal_their_names():
  """shaping, sigma schedule and optimizer given as objects give the same step as the names."""
  named = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, shaping="centered_rank",
                      sigma_schedule="cosine", sigma_final=0.05, schedule_steps=4)
  objects = es.Strategy(population=4, sigma=0.1, shaping=es.centered_rank,
                        sigma_schedule=lambda v: es.sigma_at(v, "cosine", 0.1, 0.05, 4),
                        optimizer=optax.sgd(0.1))
  state = named.init(_params(), jax.random.key(9))
  state = es.ESState(state.params, state.opt_state, state.key, 2)
  results = [(2, 0, 1.0), (1, 1, 3.0), (0, 2, 2.0), (2, 3, 0.5)]
  a, ma = named.update(state, results)
  b, mb = objects.update(state, results)
  for x, y in zip(_leaves64(a.params), _leaves64(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  assert ma["sigma"] == pytest.approx(mb["sigma"])
  with pytest.raises(ValueError, match="learning_rate"):
    es.Strategy(population=4, sigma=0.1, learning_rate=0.1, optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match="learning_rate"):
    es.Strategy(population=4, sigma=0.1)


def test_strategy_holds_no_run_state():
  """Two runs with different keys through one strategy, interleaved, equal each run alone."""
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=0.1, mode="lowrank")
  def run(key, other=None):
    state = strategy.init(_params(), jax.random.key(key))
    for i in range(2):
      if other is not None:  # another run's update in between must not leak into this one
        strategy.update(other, _random_results(other, strategy.members(other), 7))
      state, _ = strategy.update(state, _random_results(state, strategy.members(state), i))
    return state
  alone = run(1)
  interleaved = run(1, other=strategy.init(_params(), jax.random.key(2)))
  for x, y in zip(_leaves64(alone.params), _leaves64(interleaved.params)):
    np.testing.assert_array_equal(x, y)
  assert not hasattr(strategy, "_run_key")

"""SAO's learner pieces (jaxes/rl/sao.py): the strict double-side clip against a plain-numpy
reference, the value positions and per-token baselines, a value-only step, the config block."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes.rl import sao
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig, SAOValueConfig, sao_from_run_config
from jaxes.train import defaults

LOW, HIGH = 0.2, 0.28


def _reference(logp, behaviour, adv, weights):
  """Plain numpy: the loss and its gradient in ``logp`` when a token outside
  [1 - LOW, 1 + HIGH] gives nothing, and the weighted clipped-token fraction."""
  ratio = np.exp(logp - behaviour)
  inside = (ratio >= 1 - LOW) & (ratio <= 1 + HIGH)
  loss = -np.sum(weights * np.where(inside, ratio * adv, 0.0))
  grad = -weights * np.where(inside, ratio * adv, 0.0)   # d(ratio)/d(logp) = ratio
  return loss, grad, np.sum(weights * ~inside)


def test_strict_clip_equals_numpy_on_both_signs_and_both_sides():
  # Ratios below, inside and above the range, each with a positive and a negative advantage
  # (PPO's min keeps the gradient of 0.5 with A > 0 and of 2.0 with A < 0; the strict clip keeps
  # neither), and a row of weight 0 (padding) with extreme ratios.
  ratios = np.array([[0.5, 0.79, 0.9, 1.0, 1.2, 1.27, 1.5, 2.0],
                     [0.5, 0.79, 0.9, 1.0, 1.2, 1.27, 1.5, 2.0],
                     [50.0, 1e-9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], np.float64)
  behaviour = np.full(ratios.shape, -1.3)
  logp = behaviour + np.log(ratios)
  adv = np.stack([np.full(8, 0.7), np.full(8, -1.1), np.full(8, 3.0)])
  weights = np.stack([np.full(8, 1 / 16), np.full(8, 1 / 16), np.zeros(8)])
  want_loss, want_grad, want_clipped = _reference(logp, behaviour, adv, weights)

  def loss(lp):
    return sao.strict_clipped_objective(lp, jnp.asarray(behaviour, jnp.float32),
                                        jnp.asarray(adv, jnp.float32),
                                        jnp.asarray(weights, jnp.float32), clip_low=LOW, clip_high=HIGH)

  (got, sums), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp, jnp.float32))
  np.testing.assert_allclose(got, want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  assert np.all(np.isfinite(np.asarray(grad)))   # the padding row's 50x ratio makes no NaN
  np.testing.assert_allclose(sums["clip_fraction"], want_clipped, rtol=1e-6)
  assert want_clipped == pytest.approx(8 / 16)   # 0.5, 0.79 | 1.5, 2.0 of both signs
  np.testing.assert_allclose(sums["clipped_low"], 4 / 16, rtol=1e-6)
  np.testing.assert_allclose(sums["clipped_high"], 4 / 16, rtol=1e-6)
  # Every clipped token has zero gradient whatever its advantage's sign; every kept one has some.
  g = np.asarray(grad)[:2]
  assert np.all(g[:, [0, 1, 6, 7]] == 0) and np.all(g[:, 2:6] != 0)


def test_value_positions_and_turn_baselines():
  #           prompt   turn 0     obs   turn 1
  sampled = jnp.array([[0, 0, 1, 1, 0, 0, 1, 1, 0]], bool)
  values = jnp.arange(9, dtype=jnp.float32)[None] * 10.0   # value "before token t" = 10 t
  turns = sao.value_positions(sampled, turn_values=True)
  assert np.asarray(turns).nonzero()[1].tolist() == [2, 6]
  first = sao.value_positions(sampled, turn_values=False)
  assert np.asarray(first).nonzero()[1].tolist() == [2]
  np.testing.assert_array_equal(sao.token_baselines(values, turns)[0],
                                [0, 0, 20, 20, 20, 20, 60, 60, 60])
  np.testing.assert_array_equal(sao.token_baselines(values, first)[0],
                                [0, 0, 20, 20, 20, 20, 20, 20, 20])


def _tiny_learner(turn_values=True):
  from flax import nnx
  from jaxes.models import qwen2
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=64, hidden_size=16, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  learner = sao.SAOLearner(graphdef, GRPOConfig(learning_rate=1e-2, micro_batches=2),
                           SAOValueConfig(learning_rate=0.1, turn_values=turn_values), cfg.hidden_size)
  return learner, params


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (4, 12)).astype(np.int32)
  valid = np.ones((4, 12), bool)
  sampled = np.zeros((4, 12), bool)
  sampled[:, 4:8] = True
  sampled[:, 10:] = True
  return Batch(jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(sampled),
               jnp.asarray(np.where(sampled, -4.2, 0.0), jnp.float32),
               jnp.asarray([1.0, 0.0, 1.0, 1.0], jnp.float32), jnp.arange(4, dtype=jnp.int32))


def test_value_warmup_step_moves_the_head_not_the_policy_and_learns_the_mean_return():
  learner, params = _tiny_learner()
  state = learner.init(params)
  before = jax.tree.map(np.asarray, state.params)
  batch, losses = _batch(), []
  for _ in range(30):
    state, m = learner.step(state, batch, train_policy=False)
    losses.append(float(m["value_loss"]))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert int(state.step) == 0
  assert losses[-1] < 0.25 * losses[0], losses   # from 0.75 (V = 0) towards the variance
  state, m = learner.step(state, batch, train_policy=True)
  assert int(state.step) == 1 and m["grad_norm"] > 0
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before),
                                                                jax.tree.leaves(state.params))]
  assert any(moved)


def test_sao_config_block_errors_name_their_key():
  c = defaults.base_config()
  c.train.algorithm = "sao"
  c.rollout.temperature = 1.0
  policy, value = sao_from_run_config(c)
  assert (policy.clip_eps_low, policy.clip_eps_high, policy.kl_coef) == (0.2, 0.28, 0.0)
  assert value.turn_values
  for key, bad, match in (("tasks_per_update", 0, r"^config.sao.tasks_per_update: must be an int >= 1"),
                          ("value_learning_rate", -1.0, r"^config.sao.value_learning_rate: must be"),
                          ("micro_batches", 3, r"^config.sao.micro_batches: must divide"),
                          ("clip_eps_low", 1.5, r"^config.sao.clip_eps_low: must be in \(0, 1\)")):
    bad_config = c.copy_and_resolve_references()
    bad_config.sao[key] = bad
    with pytest.raises(ValueError, match=match):
      sao_from_run_config(bad_config)

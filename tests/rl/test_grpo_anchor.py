"""The GRPO learner's anchored weight decay (``grpo.anchor``, and SAO's, which steps its policy
through the same ``GRPOLearner.apply_gradients``): λ = 0 is bit-identical to no anchor; λ > 0
moves the optimizer's result toward θ₀ (the learner's reference params, which stay θ₀) exactly
by the formula, on the float32 master where there is one. The ES anchor: tests/es/test_anchor.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxes.es import anchor
from jaxes.models import qwen2
from jaxes.rl import sao
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig, SAOValueConfig
from jaxes.rl.grpo import GRPOLearner

LR = 1e-2


@pytest.fixture(scope="module")
def model():
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=64, hidden_size=16, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def _batch():
  """Two groups of two episodes, rewards differing within each group (non-zero advantages)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (4, 12)).astype(np.int32)
  sampled = np.zeros((4, 12), bool)
  sampled[:, 4:8] = True
  sampled[:, 10:] = True
  return Batch(jnp.asarray(tokens), jnp.ones((4, 12), bool), jnp.asarray(sampled),
               jnp.asarray(np.where(sampled, -4.2, 0.0), jnp.float32),
               jnp.asarray([1.0, 0.0, 0.0, 1.0], jnp.float32), jnp.asarray([0, 0, 1, 1], jnp.int32))


def _grads(params, seed):
  """A float32 gradient tree like ``params`` (the optimizer step, not the loss, is under test)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _config(**kw):
  # No remat and no logprob chunks: the smallest programs (neither touches the anchor).
  return GRPOConfig(learning_rate=LR, remat=False, logprob_chunk=0, **kw)


def _apply(learner):
  """The learner's optimizer step, where the anchor is applied (``GRPOLearner.step`` calls it
  after the loss's gradients), jitted as the step jits it."""
  return jax.jit(learner.apply_gradients)


def _target(state):
  """What the optimizer updates: the float32 master, else the params."""
  return state.params if state.master is None else state.master


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_zero_decay_is_bit_identical_to_no_anchor(model):
  _, graphdef, params = model
  plain = GRPOLearner(graphdef, _config())
  off = GRPOLearner(graphdef, _config(anchor="l2", anchor_decay=0.0))
  assert not off.config.anchored and off.init(params).ref_params is None   # no θ₀ copy kept
  a, b = plain.init(params), off.init(params)
  for seed in (1, 2):
    a, b = _apply(plain)(a, _grads(params, seed)), _apply(off)(b, _grads(params, seed))
  _assert_same(a, b)
  # ... and the pull itself at step 0, as apply_gradients applies it (float32, then the dtype):
  # exact, so a schedule whose step is 0 (warm-up's first) changes no bit either.
  for kind in ("l2", "l1"):
    pull0 = jax.jit(lambda p, p0, kind=kind: jax.tree.map(
        lambda x, x0: anchor.pull(x.astype(jnp.float32), x0, kind, 0.0).astype(x.dtype), p, p0))
    _assert_same(pull0(a.params, params), a.params)


@pytest.mark.parametrize("kind,decay,dtype", [("l2", 5.0, jnp.float32), ("l1", 0.7, jnp.bfloat16)])
def test_decay_moves_theta_toward_theta0_by_the_formula(model, kind, decay, dtype):
  _, graphdef, params = model
  params = jax.tree.map(lambda x: x.astype(dtype), params)   # bf16: the float32 master is pulled
  plain = GRPOLearner(graphdef, _config())
  anchored = GRPOLearner(graphdef, _config(anchor=kind, anchor_decay=decay))
  state = _apply(anchored)(anchored.init(params), _grads(params, 1))   # one update away from θ₀
  # The next update with and without the pull, from the same state (the plain learner carries
  # the reference params through untouched).
  stepped = _apply(plain)(state, _grads(params, 2))
  pulled = _apply(anchored)(state, _grads(params, 2))
  theta0 = jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32), np.float64), params)
  t = LR * decay
  for p0, p1, got in zip(jax.tree.leaves(theta0), jax.tree.leaves(_target(stepped)),
                         jax.tree.leaves(_target(pulled)), strict=True):
    assert got.dtype == jnp.float32
    d = np.asarray(p1, np.float64) - p0
    want = p0 + (1 - t) * d if kind == "l2" else p0 + np.sign(d) * np.maximum(np.abs(d) - t, 0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6)
    assert np.all(np.abs(np.asarray(got, np.float64) - p0) <= np.abs(d) + 1e-6)   # toward θ₀
  if kind == "l1":   # the soft-threshold puts small offsets exactly on θ₀ (in the master)
    landed = [np.asarray(g) == np.asarray(p0, np.float32)
              for p0, g in zip(jax.tree.leaves(theta0), jax.tree.leaves(_target(pulled)))]
    assert any(x.any() for x in landed) and not all(x.all() for x in landed)
  if pulled.master is not None:   # the forward's params are the pulled master, cast
    _assert_same(jax.tree.map(lambda m, p: m.astype(p.dtype), pulled.master, pulled.params),
                 pulled.params)
  _assert_same(pulled.ref_params, params)   # the anchor stays θ₀, update after update


def test_sao_policy_is_pulled_by_the_same_formula(model):
  cfg, graphdef, params = model
  batch, decay = _batch(), 5.0
  value = SAOValueConfig(learning_rate=0.1, turn_values=True)
  plain = sao.SAOLearner(graphdef, _config(), value, cfg.hidden_size)
  anchored = sao.SAOLearner(graphdef, _config(anchor="l2", anchor_decay=decay), value, cfg.hidden_size)
  state = anchored.init(params)
  assert state.ref_params is not None
  stepped, _ = plain.step(plain.init(params), batch)   # from θ₀ itself: the same AdamW step
  pulled, _ = anchored.step(state, batch)
  t = LR * decay
  for p0, p1, got in zip(jax.tree.leaves(params), jax.tree.leaves(stepped.params),
                         jax.tree.leaves(pulled.params), strict=True):
    p0 = np.asarray(p0, np.float64)
    want = p0 + (1 - t) * (np.asarray(p1, np.float64) - p0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6)
  _assert_same(pulled.value, stepped.value)   # the value head is not anchored

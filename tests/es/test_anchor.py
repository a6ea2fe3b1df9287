"""Anchored weight decay (jaxes.es.anchor): λ = 0 changes no bit, λ > 0 moves θ toward θ₀ by the
documented formula, in the jitted ES update; the drift measures' pieces on plain pytrees."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes import es
from jaxes.es import anchor
from jaxes.train import drift

RESULTS = [(0, 0, 1.0), (0, 1, -0.5), (0, 2, 0.25), (0, 3, 2.0)]
LR = 0.05


def _params(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return {"layers": {"mlp": {"kernel": jax.random.normal(k[0], (2, 8, 6))}},
          "embed": {"embedding": jax.random.normal(k[2], (16, 8)).astype(jnp.bfloat16)}}


def _step(strategy, params, initial=None):
  state = strategy.init(params, jax.random.key(1))
  if initial is not None:   # start away from θ₀, as after some updates
    state = es.ESState(params, state.opt_state, state.key, 3)
  return strategy.update(state, [(3 if initial is not None else 0, m, f) for _, m, f in RESULTS],
                         initial)[0].params


def test_zero_decay_is_bit_identical_to_no_anchor():
  theta0, theta = _params(0), _params(1)
  plain = _step(es.Strategy(population=4, sigma=0.1, learning_rate=LR), theta, theta0)
  for kind in ("l2", "l1"):
    # The option off (λ = 0 means no anchor: the same program) ...
    off = _step(es.Strategy(population=4, sigma=0.1, learning_rate=LR, anchor=kind, anchor_decay=0.0),
                theta, theta0)
    # ... and the pull itself at step 0, jitted as the update applies it (float32, then the dtype).
    pull0 = jax.jit(lambda p, p0: jax.tree.map(
        lambda x, x0: anchor.pull(x.astype(jnp.float32), x0, kind, 0.0).astype(x.dtype), p, p0))
    for a, b, c in zip(jax.tree.leaves(plain), jax.tree.leaves(off),
                       jax.tree.leaves(pull0(plain, theta0))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("kind,decay", [("l2", 4.0), ("l1", 0.5)])
def test_decay_moves_theta_toward_theta0_by_the_formula(kind, decay):
  theta0, theta = _params(0), _params(1)
  stepped = _step(es.Strategy(population=4, sigma=0.1, learning_rate=LR), theta, theta0)
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=LR, anchor=kind, anchor_decay=decay)
  assert strategy.anchored and not strategy.steps_are_lowrank
  anchored = _step(strategy, theta, theta0)
  t = LR * decay
  for p0, p1, got in zip(jax.tree.leaves(theta0), jax.tree.leaves(stepped), jax.tree.leaves(anchored)):
    p0, p1 = np.asarray(p0, np.float64), np.asarray(p1, np.float64)
    d = p1 - p0
    want = p0 + (1 - t) * d if kind == "l2" else p0 + np.sign(d) * np.maximum(np.abs(d) - t, 0)
    # float32 arithmetic, cast to the leaf's dtype (bf16 embeddings: one bf16 rounding)
    tol = 1e-2 if got.dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    # and toward θ₀: never further from it than the unanchored step
    assert np.all(np.abs(np.asarray(got, np.float64) - p0) <= np.abs(d) + tol)
  if kind == "l1":   # the soft-threshold puts small offsets exactly on θ₀
    kernel0, kernel = np.asarray(theta0["layers"]["mlp"]["kernel"]), np.asarray(anchored["layers"]["mlp"]["kernel"])
    small = np.abs(np.asarray(stepped["layers"]["mlp"]["kernel"]) - kernel0) <= t
    assert small.any() and np.array_equal(kernel[small], kernel0[small])


def test_anchor_settings_are_checked():
  with pytest.raises(ValueError, match="anchor must be one of"):
    es.Strategy(population=4, sigma=0.1, learning_rate=LR, anchor="l3", anchor_decay=1.0)
  with pytest.raises(ValueError, match="anchor_decay must be"):
    es.Strategy(population=4, sigma=0.1, learning_rate=LR, anchor="l2", anchor_decay=-1.0)
  import optax
  with pytest.raises(ValueError, match="anchor needs optimizer"):
    es.Strategy(population=4, sigma=0.1, optimizer=optax.sgd(0.1), anchor="l2", anchor_decay=1.0)
  strategy = es.Strategy(population=4, sigma=0.1, learning_rate=LR, anchor="l2", anchor_decay=1.0)
  with pytest.raises(ValueError, match="update needs initial"):
    strategy.update(strategy.init(_params(), jax.random.key(0)), RESULTS)


def test_pull_closed_forms():
  x, x0 = jnp.array([1.0, -0.2, 0.05, 3.0]), jnp.zeros(4)
  np.testing.assert_allclose(anchor.pull(x, x0, "l2", 0.5), [0.5, -0.1, 0.025, 1.5])
  np.testing.assert_allclose(anchor.pull(x, x0, "l1", 0.1), [0.9, -0.1, 0.0, 2.9])
  assert anchor.pull(x, x0, "none", 0.5) is x


def test_drift_groups_and_update_cosine():
  names = ["embed/embedding/value", "layers/attn/q_proj/kernel/value", "layers/mlp/up_proj/kernel/value",
           "layers/input_norm/scale/value", "final_norm/scale/value", "lm_head/kernel/value", "other"]
  assert [drift.group_of(n) for n in names] == ["embeddings", "attention", "mlp", "norms", "norms",
                                                "embeddings", None]
  a = {"w": jnp.zeros(3)}
  b = {"w": jnp.array([1.0, 0.0, 0.0])}
  assert drift.update_cosine(a, b, {"w": jnp.array([2.0, 0.0, 0.0])}) == pytest.approx(1.0)
  assert drift.update_cosine(a, b, {"w": jnp.array([1.0, 1.0, 0.0])}) == pytest.approx(0.0)
  assert drift.update_cosine(a, a, a) == 0.0   # 0/0: no change, no direction

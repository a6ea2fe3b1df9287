"""The GRPO learner on an 8-device CPU mesh (data x fsdp x tensor = 2 x 2 x 2): parameters stay
in their shardings, the optimizer state is also split over data, episode rows are split over
data, and the step equals the same step on one device."""
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxes import sharding
from jaxes.models import partition, qwen2
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig
from jaxes.rl.grpo import GRPOLearner


def test_sharded_step_keeps_shardings_and_equals_one_device():
  assert jax.device_count() >= 8, "conftest sets 8 host devices"
  cfg = qwen2.Qwen2Config.preset("tiny-gqa", vocab_size=64)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
  graphdef, params = partition.init_params(cfg, mesh, seed=0)
  rng = np.random.default_rng(0)
  rows, seq = 8, 16
  sampled = np.zeros((rows, seq), bool)
  sampled[:, 5:12] = True
  host = Batch(tokens=rng.integers(0, 64, (rows, seq)).astype(np.int32), valid=np.ones((rows, seq), bool),
               sampled=sampled, behaviour_logp=np.where(sampled, -4.0, 0.0).astype(np.float32),
               rewards=rng.random(rows).astype(np.float32), group_ids=np.repeat(np.arange(4), 2).astype(np.int32))
  on_data = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))
  batch = jax.tree.map(on_data, host)
  # A large Adam epsilon keeps the first step smooth in the gradient (with 1e-8 it is about
  # lr * sign(grad), which rounding flips where a gradient component is near zero).
  learner = GRPOLearner(graphdef, GRPOConfig(learning_rate=1e-3, micro_batches=2, kl_coef=0.1,
                                             adam_eps=1e-2))
  state = learner.init(params)
  want = jax.tree.map(lambda x: x.sharding, params)
  state, metrics = learner.step(state, batch)
  got = jax.tree.map(lambda x: x.sharding, state.params)
  for w, g, x in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(state.params)):
    assert g.is_equivalent_to(w, x.ndim), (w, g)
  # AdamW's moments: the parameter's sharding, also split over data (grpo.optimizer_over_data).
  mu = state.opt_state[1][0].mu
  for w, g, x in zip(jax.tree.leaves(want), jax.tree.leaves(jax.tree.map(lambda x: x.sharding, mu)), jax.tree.leaves(mu)):
    assert g.is_equivalent_to(learner.learner_sharding(w, x), x.ndim), (w, g)
    assert "data" in jax.tree.leaves(tuple(g.spec)) and not g.is_equivalent_to(w, x.ndim), (w, g)
    assert np.prod(g.shard_shape(x.shape)) * 2 == np.prod(w.shard_shape(x.shape))  # half per device

  one = jax.devices()[0]
  local = jax.tree.map(lambda x: jax.device_put(np.asarray(x), one), params)
  ref_state, ref_metrics = learner.step(learner.init(local), jax.tree.map(lambda x: jax.device_put(x, one), host))
  for key in ("loss", "kl", "grad_norm", "clip_fraction"):
    np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)

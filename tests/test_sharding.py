"""Mesh, logical-axis rules, sharded init/load, and logits on an 8-device CPU mesh."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxes import sharding
from jaxes.models import hf, partition, qwen2
from helpers_models import save_random_hf_checkpoint

needs_8_devices = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

CFG = qwen2.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False)


def test_parse_mesh():
  assert sharding.parse_mesh("data=1,fsdp=4,tensor=2") == {"data": 1, "fsdp": 4, "tensor": 2}
  assert sharding.parse_mesh("fsdp=8") == {"data": 1, "fsdp": 8, "tensor": 1}
  with pytest.raises(ValueError, match="at 'model=2'"):
    sharding.parse_mesh("data=1,model=2")


def test_mesh_that_does_not_divide_heads_names_the_numbers():
  seven = qwen2.Qwen2Config.preset("qwen2.5-7b")
  with pytest.raises(ValueError, match="tensor=7 does not divide num_kv_heads=4"):
    partition.check_divisible(seven, {"tensor": 7})
  with pytest.raises(ValueError, match="tensor=3 does not divide num_heads=28"):
    partition.check_divisible(seven, {"tensor": 3})
  with pytest.raises(ValueError, match=r"dimension 1 \(mlp\) has size 80, not divisible by mesh "
                                       r"axes tensor = 3"):
    sharding.state_specs(partition.abstract_params(qwen2.Qwen2Config(
      vocab_size=96, hidden_size=60, intermediate_size=80, num_layers=1, num_heads=3,
      num_kv_heads=3)), {"tensor": 3})


def test_7b_bytes_per_device_on_8way_fsdp_from_abstract_shapes():
  cfg = qwen2.Qwen2Config.preset("qwen2.5-7b", param_dtype="bfloat16", dtype="bfloat16")
  state = partition.abstract_params(cfg)
  leaves = [v for _, v in nnx.to_flat_state(state)]
  total = sum(math.prod(v.shape) * 2 for v in leaves)
  # fsdp splits every leaf with an "embed" axis; norm gains and biases stay replicated.
  replicated = sum(math.prod(v.shape) * 2 for v in leaves
                   if "embed" not in v.get_metadata()["logical_axes"])
  assert total == 7_615_616_512 * 2  # Qwen2.5-7B's published parameter count
  per_device = sharding.bytes_per_device(state, {"fsdp": 8})
  assert per_device == (total - replicated) // 8 + replicated


@pytest.mark.end_to_end
def test_sharding_imports_no_model():
  import subprocess, sys
  code = "import sys, jaxes.sharding; print(sorted(m for m in sys.modules if m.startswith('jaxes.models')))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


def test_cache_keeps_kv_heads_whole_when_tensor_does_not_divide_them():
  seven = qwen2.Qwen2Config.preset("qwen2.5-7b")
  assert partition.cache_specs(seven, {"data": 8, "tensor": 2}).k == P(None, "data", None, "tensor", None)
  assert partition.cache_specs(seven, {"tensor": 8}).k == P(None, "data", None, None, None)


@needs_8_devices
def test_sharded_logits_equal_single_device(tmp_path):
  save_random_hf_checkpoint(str(tmp_path), CFG, seed=3)
  _, graphdef, single = hf.load(str(tmp_path))
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  _, _, sharded = hf.load(str(tmp_path), mesh=mesh)
  q = nnx.to_pure_dict(sharded)["layers"]["attn"]["q_proj"]["kernel"]
  assert q.sharding.spec == P(None, "fsdp", "tensor")
  assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 32, 32)

  rng = np.random.RandomState(0)
  B, T = 2, 7
  tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (B, T)))
  valid = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3]]))  # second row left-padded
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  forward = jax.jit(qwen2.forward, static_argnums=0)
  ref, _ = forward(graphdef, single, tokens, positions, valid)
  out, _ = forward(graphdef, sharded, tokens, positions, valid)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)

  # Prefill + one decode step with a cache sharded by its logical axes.
  cache = jax.device_put(qwen2.KVCache.init(CFG, B, 16), partition.cache_shardings(CFG, mesh))
  assert cache.k.sharding.spec == P(None, "data", None, "tensor", None)
  _, cache = forward(graphdef, sharded, tokens, positions, valid, cache)
  nxt = jnp.asarray([[5], [9]])
  step, _ = forward(graphdef, sharded, nxt, positions[:, -1:] + 1, jnp.ones((B, 1), bool), cache)
  full, _ = forward(graphdef, single, jnp.concatenate([tokens, nxt], 1),
                    jnp.concatenate([positions, positions[:, -1:] + 1], 1),
                    jnp.concatenate([valid, jnp.ones((B, 1), bool)], 1))
  np.testing.assert_allclose(np.asarray(step)[:, 0], np.asarray(full)[:, -1], atol=1e-5, rtol=0)


@needs_8_devices
def test_sharded_init_places_every_parameter():
  mesh = sharding.make_mesh(fsdp=4, tensor=2)
  graphdef, params = partition.init_params(CFG, mesh, seed=0)
  specs = sharding.state_specs(params, mesh)
  for array, spec in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    assert array.sharding.spec == spec
  _, plain = nnx.split(qwen2.Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(0)), nnx.Param)
  for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(params)), jax.tree.leaves(nnx.to_pure_dict(plain))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  with pytest.raises(ValueError, match="= 4 devices, but 8 devices were given"):
    sharding.make_mesh(fsdp=2, tensor=2)

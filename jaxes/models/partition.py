"""Where the Qwen2 model's parameters and KV cache live on a device mesh.

The generic machinery (mesh axes, the logical-axis rule table, specs from ``logical_axes``
metadata) is ``jaxes.sharding``; this module applies it to this model: abstract parameters, a
sharded random init, the cache's shardings, and the divisibility checks that name the numbers.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxes import sharding
from jaxes.models.qwen2 import KVCache, PagedKVCache, Qwen2Config, Qwen2ForCausalLM


def check_divisible(cfg: Qwen2Config, mesh: Mesh | Mapping[str, int]) -> None:
  """Fail early, naming the numbers, when the mesh cannot split the model's heads."""
  tensor = sharding.mesh_sizes(mesh)["tensor"]
  for key in ("num_heads", "num_kv_heads"):
    if getattr(cfg, key) % tensor:
      raise ValueError(f"mesh tensor={tensor} does not divide {key}={getattr(cfg, key)}; "
                       f"choose tensor among the divisors of {getattr(cfg, key)}")


def abstract_params(cfg: Qwen2Config) -> nnx.State:
  """Parameter shapes/dtypes with their metadata, without allocating anything."""
  return nnx.state(nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def param_shardings(cfg: Qwen2Config, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = sharding.LOGICAL_RULES) -> nnx.State:
  """NamedSharding per parameter, as an ``nnx.State`` with the structure of ``nnx.split``'s
  params (so it can be a jit's ``in_shardings`` for them)."""
  check_divisible(cfg, mesh)
  state = abstract_params(cfg)
  nnx.replace_by_pure_dict(state, sharding.state_shardings(state, mesh, rules))
  return state


def abstract_sharded_params(cfg: Qwen2Config, mesh: Mesh,
                            rules: Sequence[tuple[str, Any]] = sharding.LOGICAL_RULES) -> nnx.State:
  """``jax.ShapeDtypeStruct`` per parameter carrying its sharding: lower and compile programs
  over the parameters without any of them existing."""
  shapes, shardings = abstract_params(cfg), param_shardings(cfg, mesh, rules)
  return sharding.abstract(shapes, shardings)


def init_params(cfg: Qwen2Config, mesh: Mesh, seed: int = 0,
                rules: Sequence[tuple[str, Any]] = sharding.LOGICAL_RULES
                ) -> tuple[nnx.GraphDef, nnx.State]:
  """Randomly initialised parameters created directly in their shardings (jit with
  out_shardings), so no device ever holds a full copy."""
  check_divisible(cfg, mesh)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)

  def create():
    return nnx.to_pure_dict(nnx.state(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param))

  arrays = jax.jit(create, out_shardings=sharding.state_shardings(params, mesh, rules))()
  nnx.replace_by_pure_dict(params, arrays)
  return graphdef, params


def cache_specs(cfg: Qwen2Config, mesh: Mesh | Mapping[str, int],
                rules: Sequence[tuple[str, Any]] = sharding.LOGICAL_RULES,
                paged: bool = False) -> KVCache | PagedKVCache:
  """PartitionSpecs of a ``KVCache`` (same pytree structure; ``paged``: a ``PagedKVCache``,
  whose pages go over the slots' axis) under the rules, except that the KV heads stay whole
  when the mesh axis does not divide them (Qwen2.5-7B has 4 KV heads, so tensor=8 shards its
  query heads and MLP but not its cache)."""
  sizes = sharding.mesh_sizes(mesh)
  heads_axis = dict(rules).get("kv_heads")
  keep_heads = cfg.num_kv_heads % sharding.shards(heads_axis, sizes) != 0
  table = tuple((name, None if keep_heads and name == "kv_heads" else axis)
                for name, axis in rules)
  cls = PagedKVCache if paged else KVCache
  return cls(**{k: sharding.logical_to_spec(v, table) for k, v in cls.LOGICAL_AXES.items()},
             dtype=jnp.dtype(cfg.dtype).name)  # the cache's own (static) dtype: same pytree


def cache_shardings(cfg: Qwen2Config, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = sharding.LOGICAL_RULES,
                    paged: bool = False) -> KVCache | PagedKVCache:
  """NamedShardings of a ``KVCache`` or ``PagedKVCache`` (see ``cache_specs``)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(cfg, mesh, rules, paged),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))

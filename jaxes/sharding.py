"""Device mesh over (data, fsdp, tensor) and the logical-axis rule table (MaxText-style names).

Parameters and the KV cache are declared with logical axis names (``embed``, ``heads``, ``mlp``,
``vocab``, ...); ``LOGICAL_RULES`` maps each name to mesh axes. ``data`` shards the batch (the ES
population), ``fsdp`` the model's embedding dimension, ``tensor`` its heads / MLP / vocabulary.

    python -m jaxes.sharding --preset qwen2.5-7b --mesh fsdp=8 --param_dtype bfloat16

prints bytes per device from abstract shapes (nothing is allocated).
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
  ("batch", "data"),
  ("cache_batch", "data"),
  ("cache_seq", None),
  ("layers", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("mlp", "tensor"),
  ("norm", None),
)


def parse_mesh(spec: str) -> dict[str, int]:
  """``"data=1,fsdp=4,tensor=2"`` -> ``{"data": 1, "fsdp": 4, "tensor": 2}`` (missing axes = 1)."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, sep, value = part.partition("=")
    if not sep or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
      raise ValueError(f"bad mesh spec {spec!r} at {part!r}: expected comma-separated "
                       f"AXIS=N with AXIS in {MESH_AXES} and N >= 1")
    sizes[name] = int(value)
  return sizes


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over ``devices`` (default: all), whose count must match."""
  devices = list(jax.devices() if devices is None else devices)
  shape = (data, fsdp, tensor)
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {math.prod(shape)} "
                     f"devices, but {len(devices)} devices were given")
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(axes: Sequence[str | None],
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> PartitionSpec:
  table = dict(rules)
  for name in axes:
    if name is not None and name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
  return PartitionSpec(*(None if name is None else table[name] for name in axes))


def _mesh_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
  return dict(mesh.shape) if isinstance(mesh, Mesh) else {**dict.fromkeys(MESH_AXES, 1), **mesh}


def _shards(entry: Any, sizes: Mapping[str, int]) -> int:
  names = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(sizes[n] for n in names)


def check_divisible(cfg, mesh: Mesh | Mapping[str, int]) -> None:
  """Fail early, naming the numbers, when the mesh cannot split the model's heads."""
  sizes = _mesh_sizes(mesh)
  tensor = sizes["tensor"]
  for key in ("num_heads", "num_kv_heads"):
    if getattr(cfg, key) % tensor:
      raise ValueError(f"mesh tensor={tensor} does not divide {key}={getattr(cfg, key)}; "
                       f"choose tensor among the divisors of {getattr(cfg, key)}")


def _flat_variables(state: nnx.State) -> list[tuple[tuple[str, ...], nnx.Variable]]:
  return [(tuple(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]


def _nest(flat: list[tuple[tuple[str, ...], Any]]) -> dict:
  out: dict = {}
  for path, value in flat:
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def _flat_specs(state: nnx.State, mesh: Mesh | Mapping[str, int],
                rules: Sequence[tuple[str, Any]]):
  """(path, variable, PartitionSpec) per parameter, checking that every sharded dimension
  divides evenly; the error names the parameter and the numbers."""
  sizes = _mesh_sizes(mesh)
  out = []
  for path, var in _flat_variables(state):
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
      raise ValueError(f"parameter {'/'.join(path)} has no logical_axes metadata")
    spec = logical_to_spec(axes, rules)
    for dim, (size, entry) in enumerate(zip(var.shape, spec)):
      if size % _shards(entry, sizes):
        raise ValueError(f"parameter {'/'.join(path)} dimension {dim} ({axes[dim]}) has size "
                         f"{size}, not divisible by mesh axes {entry} = {_shards(entry, sizes)}")
    out.append((path, var, spec))
  return out


def state_specs(state: nnx.State, mesh: Mesh | Mapping[str, int],
                rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> dict:
  """PartitionSpec per parameter, as a pure dict like ``state.to_pure_dict()``."""
  return _nest([(path, spec) for path, _, spec in _flat_specs(state, mesh, rules)])


def state_shardings(state: nnx.State, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> dict:
  """NamedSharding per parameter, as a pure dict."""
  return _nest([(path, NamedSharding(mesh, spec))
                for path, _, spec in _flat_specs(state, mesh, rules)])


def cache_shardings(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES):
  """NamedShardings for a ``KVCache`` (same pytree structure)."""
  from jaxes.models.qwen2 import KVCache
  specs = {k: NamedSharding(mesh, logical_to_spec(v, rules)) for k, v in KVCache.LOGICAL_AXES.items()}
  return KVCache(**specs)


def bytes_per_device(state: nnx.State, mesh: Mesh | Mapping[str, int],
                     rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> int:
  """Bytes of ``state`` held by one device under the rules, from shapes alone."""
  sizes = _mesh_sizes(mesh)
  total = 0
  for _, var, spec in _flat_specs(state, sizes, rules):
    local = [size // _shards(entry, sizes) for size, entry in zip(var.shape, spec)]
    total += math.prod(local) * np.dtype(var.dtype).itemsize
  return total


def abstract_params(cfg) -> nnx.State:
  """Parameter shapes/dtypes with their metadata, without allocating anything."""
  from jaxes.models.qwen2 import Qwen2ForCausalLM
  model = nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


def init_params(cfg, mesh: Mesh, seed: int = 0,
                rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> tuple[nnx.GraphDef, nnx.State]:
  """Randomly initialised parameters created directly in their shardings (jit with
  out_shardings), so no device ever holds a full copy."""
  from jaxes.models.qwen2 import Qwen2ForCausalLM
  check_divisible(cfg, mesh)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)

  def create():
    return nnx.to_pure_dict(nnx.state(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param))

  arrays = jax.jit(create, out_shardings=state_shardings(params, mesh, rules))()
  nnx.replace_by_pure_dict(params, arrays)
  return graphdef, params


def main(argv: Sequence[str] | None = None) -> None:
  from jaxes.models.qwen2 import Qwen2Config
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen2.5-7b")
  parser.add_argument("--mesh", default="fsdp=8")
  parser.add_argument("--param_dtype", default="bfloat16")
  args = parser.parse_args(argv)
  cfg = Qwen2Config.preset(args.preset, param_dtype=args.param_dtype, dtype=args.param_dtype)
  sizes = parse_mesh(args.mesh)
  check_divisible(cfg, sizes)
  state = abstract_params(cfg)
  total = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for _, v in _flat_variables(state))
  per_device = bytes_per_device(state, sizes)
  print(f"{args.preset} ({args.param_dtype}) on mesh {sizes}: "
        f"{total / 2**30:.2f} GiB of parameters, {per_device / 2**30:.2f} GiB per device "
        f"({per_device} bytes)")


if __name__ == "__main__":
  main()

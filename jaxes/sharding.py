"""Device mesh over (data, fsdp, tensor) and the logical-axis rule table (MaxText-style names).

Parameters and the KV cache are declared with logical axis names (``embed``, ``heads``, ``mlp``,
``vocab``, ...); ``LOGICAL_RULES`` maps each name to mesh axes. ``data`` shards the batch (the
engine's slots, i.e. the ES population), ``fsdp`` the model's embedding dimension, ``tensor`` its
heads / MLP / vocabulary. Nothing here knows a model: ``jaxes.models.partition`` applies the
rules to Qwen2, and ``python -m jaxes.preflight`` sizes a whole run per device (parameters,
cache, noiser, optimizer, compiled temporaries) — this module's ``bytes_per_device`` counts the
bytes of a parameter tree only.
"""
from __future__ import annotations

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


def abstract(tree, shardings):
  """``tree``'s array leaves as ``jax.ShapeDtypeStruct``s carrying ``shardings`` (a matching
  pytree): what ``jit(...).lower`` takes to compile over arrays that need not exist. Leaves
  without a shape (Python scalars) are kept as they are."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                      if hasattr(x, "shape") else x, tree, shardings)


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


def mesh_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
  """Axis name -> size, from a mesh or a partial mapping (missing axes = 1)."""
  return dict(mesh.shape) if isinstance(mesh, Mesh) else {**dict.fromkeys(MESH_AXES, 1), **mesh}


def shards(entry: Any, sizes: Mapping[str, int]) -> int:
  """Into how many pieces a PartitionSpec entry (None, an axis, or a tuple of axes) splits."""
  names = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(sizes[n] for n in names)


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
  sizes = mesh_sizes(mesh)
  out = []
  for path, var in _flat_variables(state):
    axes = var.get_metadata().get("logical_axes")
    if axes is None:
      raise ValueError(f"parameter {'/'.join(path)} has no logical_axes metadata")
    spec = logical_to_spec(axes, rules)
    for dim, (size, entry) in enumerate(zip(var.shape, spec)):
      if size % shards(entry, sizes):
        raise ValueError(f"parameter {'/'.join(path)} dimension {dim} ({axes[dim]}) has size "
                         f"{size}, not divisible by mesh axes {entry} = {shards(entry, sizes)}")
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


def bytes_per_device(state: nnx.State, mesh: Mesh | Mapping[str, int],
                     rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> int:
  """Bytes of ``state`` held by one device under the rules, from shapes alone."""
  sizes = mesh_sizes(mesh)
  total = 0
  for _, var, spec in _flat_specs(state, sizes, rules):
    local = [size // shards(entry, sizes) for size, entry in zip(var.shape, spec)]
    total += math.prod(local) * np.dtype(var.dtype).itemsize
  return total

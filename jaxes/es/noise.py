"""Per-leaf perturbation plan and in-graph noise generation (never stored, always regenerated).

Every parameter leaf gets one of three kinds:

* ``"lowrank"`` (low-rank mode, 2-D matrices per layer): ``eps = A @ B.T / sqrt(r)`` with
  ``A [in, r]``, ``B [out, r]`` standard normal, so each entry of ``eps`` has unit variance;
* ``"full"``: i.i.d. standard normal of the leaf's shape (every leaf in full mode; vectors and
  other non-matrix leaves in low-rank mode);
* ``"frozen"``: never perturbed nor updated (vectors, i.e. 1-D per layer, when
  ``perturb_vectors=False``).

Leaves whose path starts with one of the ``scanned`` prefixes are stacked decoder-layer
parameters ``[L, ...]``; their noise is drawn per layer from ``fold_in(leaf_key, layer)``, exactly
as the noiser does inside the model's layer scan.
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from jaxes.es import keys


@dataclasses.dataclass(frozen=True)
class NoiseConfig:
  mode: str = "full"            # "full" | "lowrank"
  rank: int = 1
  antithetic: bool = True
  perturb_vectors: bool = True
  scanned: tuple[str, ...] = ("layers",)
  frozen: tuple[str, ...] = ()  # regexes (re.search) of parameter names left unperturbed


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  name: str
  shape: tuple[int, ...]
  dtype: str
  stacked: bool
  kind: str

  @property
  def layer_shape(self) -> tuple[int, ...]:
    return self.shape[1:] if self.stacked else self.shape


def leaf_spec(name: str, shape, dtype, cfg: NoiseConfig) -> LeafSpec:
  shape = tuple(int(s) for s in shape)
  stacked = name.split("/", 1)[0] in cfg.scanned
  if stacked and not shape:
    raise ValueError(f"scanned parameter {name!r} has no leading layer axis (shape {shape})")
  layer_ndim = len(shape) - int(stacked)
  if any(re.search(pattern, name) for pattern in cfg.frozen):
    kind = "frozen"
  elif layer_ndim == 2 and cfg.mode == "lowrank":
    kind = "lowrank"
  elif layer_ndim <= 1 and not cfg.perturb_vectors:
    kind = "frozen"
  else:
    kind = "full"
  return LeafSpec(name, shape, jnp.dtype(dtype).name, stacked, kind)


def plan(params, cfg: NoiseConfig) -> list[LeafSpec]:
  """One ``LeafSpec`` per leaf of ``params``, in ``tree_leaves`` order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  specs = [leaf_spec(keys.param_name(path), leaf.shape, leaf.dtype, cfg) for path, leaf in flat]
  names = [s.name for s in specs]
  if len(set(names)) != len(names):
    raise ValueError(f"parameter names are not unique: {sorted(n for n in names if names.count(n) > 1)}")
  return specs


def _per_layer(fn, key: jax.Array, spec: LeafSpec):
  if not spec.stacked:
    return fn(key)
  layer_keys = jax.vmap(lambda l: jax.random.fold_in(key, l))(jnp.arange(spec.shape[0]))
  return jax.vmap(fn)(layer_keys)


def full_noise(mkey: jax.Array, spec: LeafSpec) -> jax.Array:
  """Standard-normal float32 noise of ``spec.shape`` for one member."""
  key = keys.leaf_key(mkey, spec.name)
  return _per_layer(lambda k: jax.random.normal(k, spec.layer_shape, jnp.float32), key, spec)


def lowrank_factors(mkey: jax.Array, spec: LeafSpec, rank: int) -> tuple[jax.Array, jax.Array]:
  """``A [(L,) in, r]``, ``B [(L,) out, r]`` float32 for one member; ``eps = A B^T / sqrt(r)``."""
  n_in, n_out = spec.layer_shape
  key = keys.leaf_key(mkey, spec.name)

  def one_layer(k):
    ab = jax.random.normal(k, (n_in + n_out, rank), jnp.float32)
    return ab[:n_in], ab[n_in:]

  return _per_layer(one_layer, key, spec)


def lowrank_product(a: jax.Array, b: jax.Array) -> jax.Array:
  rank = a.shape[-1]
  return jnp.einsum("...ir,...or->...io", a, b) / math.sqrt(rank)


def leaf_noise(mkey: jax.Array, spec: LeafSpec, rank: int) -> jax.Array:
  """This member's ``eps`` for one leaf, materialised in float32 (zeros for frozen leaves)."""
  if spec.kind == "frozen":
    return jnp.zeros(spec.shape, jnp.float32)
  if spec.kind == "lowrank":
    return lowrank_product(*lowrank_factors(mkey, spec, rank))
  return full_noise(mkey, spec)

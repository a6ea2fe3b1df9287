"""ES noisers: the one object that decides how every parameterised op of the model is perturbed.

``PopulationNoiser`` implements the model's hook (``jaxes.models.noiser.Noiser``) for a batch whose
rows belong to different population members: row ``b`` uses group ``row_group[b]``, and group ``g``
is member ``members[g]`` of policy version ``versions[g]`` (member ``-1``: unperturbed). Row ``b``
then computes exactly what the model would compute with parameters ``theta + sigma_v * sign_m *
eps(v, m)`` (the same noise the ES update regenerates), up to float rounding.

How each leaf kind (see ``jaxes.es.noise``) is applied, and what it costs (G groups, B rows):

* ``lowrank`` matrices: base matmul shared by all rows, plus a per-row correction
  ``(x @ A'_g) @ B_g^T`` with ``A' = s_g A / sqrt(r)``. ``A', B`` for the G members are generated
  (and pre-scaled) once when the noiser is built and reused across decode steps. Memory: ``G * r * sum(in + out)`` float32 over
  all matrices (Qwen2.5-7B, r=1, G=64: ~0.75 GB); per-row gathers ``B * r * (in + out)`` transient.
  Compute: ~``2r/min(in, out)`` on top of the base matmul.
* ``full`` leaves: the member values ``theta + s_g * eps_g`` are materialised once per group in
  the parameter dtype. Memory: ``G * |leaf|`` (all of theta per group in full mode, i.e. G model
  copies); a matmul gathers each row's weights (``B * in * out`` transient) unless ``G == 1``.
  Use full mode with small G (one population slice per device).
* ``frozen`` leaves: the op runs on the stored parameter.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxes.es import keys, noise


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["group_scale", "row_group", "factors", "values"],
                   meta_fields=["specs"])
@dataclasses.dataclass(frozen=True)
class PopulationNoiser:
  group_scale: jax.Array  # [G] float32: sigma_v * sign_m, 0 for member -1
  row_group: jax.Array    # [B] int32
  factors: dict           # lowrank leaf name -> (s A / sqrt(r) [G, (L,) in, r], B [G, (L,) out, r])
  values: dict            # full leaf name -> member values [G, (L,) ...] in the parameter dtype
  specs: tuple            # LeafSpec per parameter leaf

  # -- helpers -------------------------------------------------------------------------------
  def _spec(self, name: str, layer) -> noise.LeafSpec:
    for spec in self.specs:
      if spec.name == name:
        if spec.stacked != (layer is not None):
          raise ValueError(f"parameter {name!r}: stacked={spec.stacked} but the model passed "
                           f"layer={'None' if layer is None else 'an index'}")
        return spec
    raise KeyError(f"the model asked to perturb {name!r}, which is not a parameter this noiser was "
                   f"built from (known: {[s.name for s in self.specs]})")

  def _check_rows(self, x: jax.Array) -> None:
    if x.shape[0] != self.row_group.shape[0]:
      raise ValueError(f"batch has {x.shape[0]} rows but row_group has {self.row_group.shape[0]}")

  @property
  def _single_group(self) -> bool:
    return self.group_scale.shape[0] == 1

  def _per_row(self, table: jax.Array, layer) -> jax.Array:
    """Select each row's group (and the layer) from a ``[G, (L,) ...]`` array."""
    return table[self.row_group] if layer is None else table[self.row_group, layer]

  def _per_group0(self, table: jax.Array, layer) -> jax.Array:
    return table[0] if layer is None else table[0, layer]

  def _vector(self, value: jax.Array, name: str, layer, like: jax.Array) -> jax.Array:
    """A perturbed vector broadcastable against ``like`` ([B, ..., n]), in ``like``'s dtype."""
    spec = self._spec(name, layer)
    if spec.kind == "frozen":
      return value.astype(like.dtype)
    if spec.kind != "full":
      raise ValueError(f"parameter {name!r} of kind {spec.kind!r} used as a vector")
    if self._single_group:
      return self._per_group0(self.values[name], layer).astype(like.dtype)
    rows = self._per_row(self.values[name], layer).astype(like.dtype)
    return rows.reshape((rows.shape[0],) + (1,) * (like.ndim - 1 - (rows.ndim - 1)) + rows.shape[1:])

  # -- the hook ------------------------------------------------------------------------------
  def dense(self, x, kernel, bias, *, name, layer=None, bias_name=None):
    self._check_rows(x)
    spec = self._spec(name, layer)
    if spec.kind == "full":
      if self._single_group:
        w = self._per_group0(self.values[name], layer)
        y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
      else:
        w = self._per_row(self.values[name], layer)
        y = jnp.einsum("b...i,bio->b...o", x, w.astype(x.dtype))
    else:
      y = jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))
      if spec.kind == "lowrank":
        a, b = (self._per_row(f, layer).astype(x.dtype) for f in self.factors[name])
        xa = jnp.einsum("b...i,bir->b...r", x, a)
        y = y + jnp.einsum("b...r,bor->b...o", xa, b)
    if bias is None:
      return y
    if bias_name is None:
      bias_name = name.rsplit("/", 1)[0] + "/bias"
    return y + self._vector(bias, bias_name, layer, y)

  def embed(self, table, ids, *, name):
    self._check_rows(ids)
    spec = self._spec(name, None)
    rows = self.row_group.reshape((-1,) + (1,) * (ids.ndim - 1))
    if spec.kind == "full":
      return self.values[name][rows, ids]
    out = jnp.take(table, ids, axis=0)
    if spec.kind == "lowrank":
      a, b = self.factors[name]
      corr = jnp.einsum("b...r,bdr->b...d", a[rows, ids], b[self.row_group])
      out = (out.astype(jnp.float32) + corr).astype(table.dtype)
    return out

  def attend(self, x, table, *, name):
    self._check_rows(x)
    spec = self._spec(name, None)
    if spec.kind == "full":
      if self._single_group:
        return jnp.einsum("...d,vd->...v", x, self.values[name][0].astype(x.dtype))
      w = self.values[name][self.row_group]
      return jnp.einsum("b...d,bvd->b...v", x, w.astype(x.dtype))
    y = jnp.einsum("...d,vd->...v", x, table.astype(x.dtype))
    if spec.kind == "lowrank":
      a, b = (f[self.row_group].astype(x.dtype) for f in self.factors[name])
      xb = jnp.einsum("b...d,bdr->b...r", x, b)
      y = y + jnp.einsum("b...r,bvr->b...v", xb, a)
    return y

  def scale(self, x, scale, *, name, layer=None):
    self._check_rows(x)
    return x * self._vector(scale, name, layer, x)


def build(params, run_key: jax.Array, versions: jax.Array, members: jax.Array,
          row_group: jax.Array, sigmas: jax.Array, cfg: noise.NoiseConfig) -> PopulationNoiser:
  """Noiser for G groups ``(versions[g], members[g])`` with per-group ``sigmas[g]`` (jittable)."""
  versions = jnp.asarray(versions, jnp.int32)
  members = jnp.asarray(members, jnp.int32)
  row_group = jnp.asarray(row_group, jnp.int32)
  if versions.ndim != 1 or versions.shape != members.shape or sigmas.shape != versions.shape:
    raise ValueError(f"versions {versions.shape}, members {members.shape} and sigmas "
                     f"{sigmas.shape} must all be [G]")
  if row_group.ndim != 1:
    raise ValueError(f"row_group must be [B], got shape {row_group.shape}")
  specs = noise.plan(params, cfg)
  active = members >= 0
  group_scale = jnp.where(active, sigmas * keys.member_sign(members, cfg.antithetic), 0.0)
  mkeys = jax.vmap(lambda v, m: keys.member_key(run_key, v, m, cfg.antithetic))(
      versions, jnp.maximum(members, 0))
  factors, values = {}, {}
  for spec, leaf in zip(specs, jax.tree_util.tree_leaves(params)):
    if spec.kind == "lowrank":
      a, b = jax.vmap(lambda k: noise.lowrank_factors(k, spec, cfg.rank))(mkeys)
      scale = (group_scale / math.sqrt(cfg.rank)).reshape((-1,) + (1,) * (a.ndim - 1))
      factors[spec.name] = (a * scale, b)
    elif spec.kind == "full":
      values[spec.name] = jax.vmap(
          lambda k, s: (leaf.astype(jnp.float32) + s * noise.full_noise(k, spec)).astype(leaf.dtype)
      )(mkeys, group_scale)
  return PopulationNoiser(group_scale.astype(jnp.float32), row_group, factors, values,
                          tuple(specs))

"""ES noisers: the one object that decides how every parameterised op of the model is perturbed.

``PopulationNoiser`` implements the model's hook (``jaxes.models.noiser.Noiser``) for a batch whose
rows belong to different population members: row ``b`` uses group ``row_group[b]``, and group ``g``
is member ``members[g]`` of policy version ``versions[g]`` (member ``-1``: unperturbed). Row ``b``
then computes exactly what the model would compute with parameters ``theta + sigma_v * sign_m *
eps(v, m)`` (the same noise the ES update regenerates), up to float rounding.

Noise is drawn once per group when the noiser is built (call ``build`` when slot assignments
change, reuse the noiser across decode steps). How each leaf kind (see ``jaxes.es.noise``) is
applied, and what it costs (G groups, B rows):

* ``lowrank`` matrices: the base matmul shared by all rows, plus a per-row correction
  ``(x @ A'_b) @ B_b^T`` with ``A' = sigma * sign * A / sqrt(r)``. The factors are stored
  pre-scaled and laid out per row, so a step does no gather. Memory: ``B * r * sum(in + out)``
  float32 over all matrices (Qwen2.5-7B, r = 1, B = 64 rows: ~0.75 GB). Compute: about
  ``2r / min(in, out)`` on top of the base matmul.
* ``full`` vectors (biases, norm gains): perturbed values stored per row, ``B * |vector|``.
* ``full`` matrices: the member weights ``theta + s_g * eps_g`` are materialised once per group in
  the parameter dtype. Memory: ``G`` copies of those leaves (in full mode: G model copies); a
  matmul gathers each row's weights (``B * in * out`` transient) unless ``G == 1`` or the rows
  come in slices (``in_slices``: G equal runs of rows, run g all of group g), where each slice
  multiplies by its own group's weights with no gather. The rollout engine's member slices
  (``ESPolicyBank(member_slices=True)``) are one group per data shard: one copy per device.
* ``frozen`` leaves: the op runs on the stored parameter.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxes.es import keys, noise


def is_vector(spec: noise.LeafSpec) -> bool:
  return len(spec.layer_shape) <= 1


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["row_group", "factors", "values", "steps", "step_rows"],
                   meta_fields=["specs", "slices"])
@dataclasses.dataclass(frozen=True)
class PopulationNoiser:
  row_group: jax.Array  # [B] int32
  factors: dict         # lowrank leaf -> (A' [B, (L,) in, r], B [B, (L,) out, r]) float32, per row
  values: dict          # full leaf -> perturbed values in the parameter dtype: vectors per row
                        # [B, (L,) n], matrices per group [G, (L,) ...]
  specs: tuple          # LeafSpec per parameter leaf
  steps: dict | None = None      # lowrank leaf -> (a [K, (L,) in, R], b [K, (L,) out, R]): K
                                 # low-rank version steps, shared by all rows (``with_steps``)
  step_rows: jax.Array | None = None   # [B, K] float32: 1 where row b adds step k, else 0
  slices: bool = False           # rows in G equal runs, run g all of group g (``in_slices``)

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

  @staticmethod
  def _at_layer(table: jax.Array, layer) -> jax.Array:
    """``table[:, layer]`` for a stacked ``[B or G, L, ...]`` array."""
    return table if layer is None else table[:, layer]

  def _group_weights(self, name: str, layer):
    """A full matrix for the op: ``([in, out], False)`` if one group, ``([G, in, out], True)``
    in slices, else ``([B, in, out], True)``."""
    per_group = self._at_layer(self.values[name], layer)
    if per_group.shape[0] == 1:
      return per_group[0], False
    if self.slices:
      return per_group, True
    return per_group[self.row_group], True

  def _per_slice(self, fn, x: jax.Array, w: jax.Array, per_row: bool = True) -> jax.Array:
    """``fn(x, w)`` on rows ``[B, ...]`` against per-row weights (shared ones: ``per_row``
    False): directly, or in slices as ``[G, B / G, ...]`` against the G groups' weights (a
    batched matmul: no gather; on a mesh whose data shards are the slices, each device
    multiplies by its own group's copy)."""
    if not (self.slices and per_row):
      return fn(x, w)
    g = w.shape[0]
    y = fn(x.reshape((g, x.shape[0] // g) + x.shape[1:]), w)
    return y.reshape((x.shape[0],) + y.shape[2:])

  def in_slices(self) -> "PopulationNoiser":
    """This noiser for rows that come in G equal runs, run g all of group g (``row_group[b] ==
    b // (B / G)``, which the caller guarantees; taking the same number of rows from each run,
    as ``select_rows`` with the engine's per-shard rows does, keeps it so)."""
    groups = {self.values[s.name].shape[0] for s in self.specs
              if s.kind == "full" and not is_vector(s)}
    rows = self.row_group.shape[0]
    if any(rows % g for g in groups):
      raise ValueError(f"in_slices: {rows} rows do not split into {sorted(groups)} equal slices")
    return dataclasses.replace(self, slices=True)

  def _vector(self, value: jax.Array, name: str, layer, like: jax.Array) -> jax.Array:
    """A perturbed vector broadcastable against ``like`` ([B, ..., n]), in ``like``'s dtype."""
    spec = self._spec(name, layer)
    if spec.kind == "frozen":
      return value.astype(like.dtype)
    if spec.kind != "full" or not is_vector(spec):
      raise ValueError(f"parameter {name!r} ({spec.kind}, shape {spec.shape}) used as a vector")
    rows = self._at_layer(self.values[name], layer).astype(like.dtype)
    return rows.reshape((rows.shape[0],) + (1,) * (like.ndim - rows.ndim) + rows.shape[1:])

  def slice_shardings(self, param_shardings, axis: str = "data") -> "PopulationNoiser":
    """Where this noiser's leaves (arrays or shapes) live when its slices are the shards of the
    mesh axis ``axis``: per-row leaves over ``axis``, and each full matrix's groups over ``axis``
    too (shard d holds group d), within a group as the parameter is (``param_shardings``: the
    parameters' ``NamedSharding`` tree), so a device holds one member copy of its own share."""
    if self.steps is not None:
      raise ValueError("slice_shardings: a noiser with version steps has no slice layout")
    flat, _ = jax.tree_util.tree_flatten_with_path(param_shardings)
    by_name = {keys.param_name(path): sh for path, sh in flat}
    mesh = next(iter(by_name.values())).mesh
    rows = NamedSharding(mesh, PartitionSpec(axis))
    values = {spec.name: rows if is_vector(spec) else
              NamedSharding(mesh, PartitionSpec(axis, *by_name[spec.name].spec))
              for spec in self.specs if spec.name in self.values}
    return PopulationNoiser(rows, jax.tree.map(lambda _: rows, self.factors), values, self.specs,
                            slices=self.slices)

  def select_rows(self, take) -> "PopulationNoiser":
    """This noiser for a batch made of some of its rows: ``take(x [B, ...]) -> [n, ...]``
    picks them from each per-row leaf (the rollout engine runs only its working rows);
    per-group weights stay as they are, found through the taken ``row_group``."""
    kinds = {spec.name: is_vector(spec) for spec in self.specs}
    return PopulationNoiser(take(self.row_group), jax.tree.map(take, self.factors),
                            {name: take(v) if kinds[name] else v for name, v in self.values.items()},
                            self.specs, self.steps,
                            None if self.step_rows is None else take(self.step_rows), self.slices)

  def with_vectors_of(self, noisers: tuple, owner: jax.Array) -> "PopulationNoiser":
    """This noiser with row b's per-row vector values taken from ``(self, *noisers)[owner[b]]``:
    noisers built for the same rows from other versions' parameters, so that each row's biases
    and norm gains are its own version's. Low-rank factors depend on keys only and stay this
    noiser's; per-group full matrices have no per-row layout and are refused."""
    values = {}
    for spec in self.specs:
      if spec.name not in self.values:
        continue
      if not is_vector(spec):
        raise ValueError(f"parameter {spec.name!r} is a full-rank matrix: its rows cannot be "
                         f"taken from another version's noiser")
      value = self.values[spec.name]
      mask = owner.reshape((-1,) + (1,) * (value.ndim - 1))
      for k, other in enumerate(noisers, start=1):
        value = jnp.where(mask == k, other.values[spec.name], value)
      values[spec.name] = value
    return dataclasses.replace(self, values=values)

  def with_steps(self, steps: dict, step_rows: jax.Array) -> "PopulationNoiser":
    """This noiser with K low-rank parameter steps added to the base matmul of every low-rank
    leaf: row b computes with ``theta + sum_k step_rows[b, k] * a_k @ b_k.T`` (``steps[name] =
    (a [K, (L,) in, R], b [K, (L,) out, R])``, e.g. ``jaxes.es.update.lowrank_step`` stacked), so
    rows of a version a few SGD steps on from the parameters passed run in the same call."""
    return dataclasses.replace(self, steps=steps, step_rows=step_rows)

  def _step_weights(self, like_ndim: int) -> jax.Array:
    """``step_rows`` as ``[B, 1 ..., K, 1]`` against ``[B, ..., K, R]`` activations."""
    w = self.step_rows
    return w.reshape(w.shape[:1] + (1,) * (like_ndim - 3) + w.shape[1:] + (1,))

  def _step_factors(self, name: str, layer, dtype):
    return tuple(self._at_layer(f, layer).astype(dtype) for f in self.steps[name])

  # -- the hook ------------------------------------------------------------------------------
  def dense(self, x, kernel, bias, *, name, layer=None, bias_name=None):
    self._check_rows(x)
    spec = self._spec(name, layer)
    if spec.kind == "full":
      w, per_row = self._group_weights(name, layer)
      pattern = "b...i,bio->b...o" if per_row else "...i,io->...o"
      y = self._per_slice(lambda x, w: jnp.einsum(pattern, x, w.astype(x.dtype)), x, w, per_row)
    else:
      y = jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))
      if spec.kind == "lowrank":
        a, b = (self._at_layer(f, layer).astype(x.dtype) for f in self.factors[name])
        y = y + jnp.einsum("b...r,bor->b...o", jnp.einsum("b...i,bir->b...r", x, a), b)
        if self.steps is not None:
          sa, sb = self._step_factors(name, layer, x.dtype)
          h = jnp.einsum("b...i,kir->b...kr", x, sa)
          y = y + jnp.einsum("b...kr,kor->b...o", h * self._step_weights(h.ndim).astype(x.dtype), sb)
    if bias is None:
      return y
    if bias_name is None:
      bias_name = name.rsplit("/", 1)[0] + "/bias"
    return y + self._vector(bias, bias_name, layer, y)

  def embed(self, table, ids, *, name):
    self._check_rows(ids)
    spec = self._spec(name, None)
    if spec.kind == "full":
      if self.slices:
        lookup = jax.vmap(lambda ids, table: jnp.take(table, ids, axis=0))
        return self._per_slice(lookup, ids, self.values[name])
      rows = self.row_group.reshape((-1,) + (1,) * (ids.ndim - 1))
      return self.values[name][rows, ids]
    out = jnp.take(table, ids, axis=0)
    if spec.kind == "lowrank":
      a, b = self.factors[name]
      rows = jnp.arange(ids.shape[0]).reshape((-1,) + (1,) * (ids.ndim - 1))
      corr = jnp.einsum("b...r,bdr->b...d", a[rows, ids], b)
      if self.steps is not None:
        sa, sb = self.steps[name]
        h = jnp.moveaxis(sa[:, ids], 0, -2)          # [K, B, ...] rows of the steps -> [B, ..., K, R]
        corr = corr + jnp.einsum("b...kr,kdr->b...d", h * self._step_weights(h.ndim), sb)
      out = (out.astype(jnp.float32) + corr).astype(table.dtype)
    return out

  def attend(self, x, table, *, name):
    self._check_rows(x)
    spec = self._spec(name, None)
    if spec.kind == "full":
      w, per_row = self._group_weights(name, None)
      pattern = "b...d,bvd->b...v" if per_row else "...d,vd->...v"
      return self._per_slice(lambda x, w: jnp.einsum(pattern, x, w.astype(x.dtype)), x, w, per_row)
    y = jnp.einsum("...d,vd->...v", x, table.astype(x.dtype))
    if spec.kind == "lowrank":
      a, b = (f.astype(x.dtype) for f in self.factors[name])
      y = y + jnp.einsum("b...r,bvr->b...v", jnp.einsum("b...d,bdr->b...r", x, b), a)
      if self.steps is not None:
        sa, sb = self._step_factors(name, None, x.dtype)
        h = jnp.einsum("b...d,kdr->b...kr", x, sb)
        y = y + jnp.einsum("b...kr,kvr->b...v", h * self._step_weights(h.ndim).astype(x.dtype), sa)
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
  group_scale = jnp.where(members >= 0, sigmas * keys.member_sign(members, cfg.antithetic), 0.0)
  mkeys = jax.vmap(lambda v, m: keys.member_key(run_key, v, m, cfg.antithetic))(
      versions, jnp.maximum(members, 0))
  factors, values = {}, {}
  for spec, leaf in zip(specs, jax.tree_util.tree_leaves(params)):
    if spec.kind == "lowrank":
      a, b = jax.vmap(lambda k: noise.lowrank_factors(k, spec, cfg.rank))(mkeys)
      scale = (group_scale / math.sqrt(cfg.rank)).reshape((-1,) + (1,) * (a.ndim - 1))
      factors[spec.name] = ((a * scale)[row_group], b[row_group])
    elif spec.kind == "full":
      per_group = jax.vmap(
          lambda k, s: (leaf.astype(jnp.float32) + s * noise.full_noise(k, spec)).astype(leaf.dtype)
      )(mkeys, group_scale)
      values[spec.name] = per_group[row_group] if is_vector(spec) else per_group
  return PopulationNoiser(row_group, factors, values, tuple(specs))

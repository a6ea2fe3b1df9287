"""The ES update: regenerate each result's noise from its key and step along ``sum_i w_i eps_i``.

``direction`` never holds more than one member's noise at a time for full leaves (a ``lax.scan``
over results with a float32 accumulator: O(|theta|) memory whatever the number of results). For
low-rank leaves it draws every result's factors (``N * r * (in + out)`` floats, small) and
contracts them in one einsum per matrix. Both are pure and jittable; ``Strategy`` wires them up.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxes.es import anchor as anchoring
from jaxes.es import keys, noise


def direction(params, run_key: jax.Array, versions: jax.Array, members: jax.Array,
              weights: jax.Array, cfg: noise.NoiseConfig):
  """``sum_i weights[i] * eps(versions[i], members[i])`` per leaf, float32, same tree as params.

  Entries with weight 0 (padding) cost no noise generation in the scan. Frozen leaves get zeros.
  """
  specs = noise.plan(params, cfg)
  treedef = jax.tree_util.tree_structure(params)
  signed = weights.astype(jnp.float32) * keys.member_sign(members, cfg.antithetic)
  mkeys = jax.vmap(lambda v, m: keys.member_key(run_key, v, m, cfg.antithetic))(versions, members)

  out = [jnp.zeros(spec.shape, jnp.float32) for spec in specs]
  full_idx = [i for i, s in enumerate(specs) if s.kind == "full"]
  for i, spec in enumerate(specs):
    if spec.kind == "lowrank":
      a, b = jax.vmap(lambda k: noise.lowrank_factors(k, spec, cfg.rank))(mkeys)
      out[i] = jnp.einsum("n,n...ir,n...or->...io", signed, a, b) / jnp.sqrt(float(cfg.rank))

  def add_member(acc, key_and_weight):
    mkey, w = key_and_weight
    acc = jax.lax.cond(
        w != 0,
        lambda acc: [a + w * noise.full_noise(mkey, specs[i]) for a, i in zip(acc, full_idx)],
        lambda acc: acc, acc)
    return acc, None

  if full_idx:
    acc, _ = jax.lax.scan(add_member, [out[i] for i in full_idx], (mkeys, signed))
    for a, i in zip(acc, full_idx):
      out[i] = a
  return jax.tree_util.tree_unflatten(treedef, out)


def apply(params, opt_state, run_key: jax.Array, versions: jax.Array, members: jax.Array,
          weights: jax.Array, count: jax.Array, cfg: noise.NoiseConfig,
          tx: optax.GradientTransformation, initial=None, anchor: str = "none",
          anchor_step: float = 0.0):
  """One step: ``theta += tx(-(1/count) * sum_i w_i eps_i)``; with ``optax.sgd(alpha)`` this is
  ``theta += (alpha/N) sum_i w_i eps_i``. With ``anchor`` ("l2" / "l1") the stepped parameters
  are then pulled toward ``initial`` (θ₀, same tree) by ``anchor_step`` = α·λ
  (``jaxes.es.anchor.pull``). All-zero weights leave params and optimizer state untouched (no
  pull either). Arithmetic in float32; each leaf is cast back to its own dtype. Frozen leaves
  never change. Returns ``(params, opt_state, update_norm)``, the norm of the applied change.
  """
  anchors = (jax.tree_util.tree_leaves(initial) if anchor != "none"
             else [None] * len(jax.tree_util.tree_leaves(params)))
  specs = noise.plan(params, cfg)

  def step(_):
    params32 = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    g = direction(params, run_key, versions, members, weights, cfg)
    grads = jax.tree_util.tree_map(lambda d: -d / jnp.maximum(count, 1).astype(jnp.float32), g)
    updates, new_opt = tx.update(grads, opt_state, params32)
    new_leaves, sq = [], jnp.float32(0)
    for spec, p, p32, u, p0 in zip(specs, jax.tree_util.tree_leaves(params),
                                   jax.tree_util.tree_leaves(params32),
                                   jax.tree_util.tree_leaves(updates), anchors):
      if spec.kind == "frozen":
        new_leaves.append(p)
        continue
      new = (p32 + u) if p0 is None else anchoring.pull(p32 + u, p0, anchor, anchor_step)
      new = new.astype(p.dtype)
      sq = sq + jnp.sum(jnp.square(new.astype(jnp.float32) - p32))
      new_leaves.append(new)
    new_params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), new_leaves)
    return new_params, new_opt, jnp.sqrt(sq)

  return jax.lax.cond(jnp.any(weights != 0), step,
                      lambda _: (params, opt_state, jnp.float32(0)), None)


def combine_pairs(versions: np.ndarray, members: np.ndarray, weights: np.ndarray, antithetic: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Merge results that share a noise key (antithetic partners of one version) into one entry.

  ``w_+ eps - w_- eps = (w_+ - w_-) eps``: the update then draws each pair's noise once, halving
  its cost when both partners are present. Returns (versions, members, weights) with members
  even (sign +1) and weights float64, in first-appearance order (deterministic).
  """
  if not antithetic:
    return versions, members, weights
  combined: dict[tuple[int, int], float] = {}
  for v, m, w in zip(versions.tolist(), members.tolist(), weights.tolist()):
    key = (v, m // 2)
    combined[key] = combined.get(key, 0.0) + (w if m % 2 == 0 else -w)
  v_out = np.array([k[0] for k in combined], np.int32)
  m_out = np.array([2 * k[1] for k in combined], np.int32)
  return v_out, m_out, np.array(list(combined.values()), np.float64)


def perturb(params, run_key: jax.Array, version: jax.Array, member: jax.Array, sigma: jax.Array,
            cfg: noise.NoiseConfig):
  """``theta + sigma * sign(member) * eps(version, member)`` materialised, leaf dtypes kept."""
  specs = noise.plan(params, cfg)
  mkey = keys.member_key(run_key, version, member, cfg.antithetic)
  scale = sigma * keys.member_sign(member, cfg.antithetic)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  out = [p if spec.kind == "frozen" else
         (p.astype(jnp.float32) + scale * noise.leaf_noise(mkey, spec, cfg.rank)).astype(p.dtype)
         for spec, p in zip(specs, leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def lowrank_step(specs, run_key: jax.Array, versions: jax.Array, members: jax.Array,
                 weights: jax.Array, count: jax.Array, *, cfg: noise.NoiseConfig,
                 learning_rate: float) -> dict:
  """``apply``'s change to every low-rank leaf under plain SGD (``tx = optax.sgd(learning_rate)``),
  left as factors: ``{name: (a [(L,) in, N*r], b [(L,) out, N*r])}`` float32 with ``a @ b.T =
  (learning_rate / count) * sum_i w_i eps_i`` on that leaf (``direction``'s sum, not multiplied
  out). ``specs``: ``noise.plan`` of the parameters (static). Jittable; N*r*(in + out) floats per
  matrix, what the noiser holds for N rows."""
  signed = weights.astype(jnp.float32) * keys.member_sign(members, cfg.antithetic)
  scale = signed * (learning_rate / jnp.maximum(count, 1).astype(jnp.float32) / np.sqrt(cfg.rank))
  mkeys = jax.vmap(lambda v, m: keys.member_key(run_key, v, m, cfg.antithetic))(versions, members)

  def by_column(f):  # [N, (L,) n, r] -> [(L,) n, N*r]
    f = jnp.moveaxis(f, 0, -2)
    return f.reshape(f.shape[:-2] + (-1,))

  out = {}
  for spec in specs:
    if spec.kind == "lowrank":
      a, b = jax.vmap(lambda k: noise.lowrank_factors(k, spec, cfg.rank))(mkeys)
      out[spec.name] = (by_column(a * scale.reshape((-1,) + (1,) * (a.ndim - 1))), by_column(b))
  return out

"""``Strategy``: the public ES API (init / members / perturbed / update / member_noiser).

Usable on any pytree of arrays, with or without an LLM::

  strategy = es.Strategy(population=64, sigma=0.05, learning_rate=0.3)
  state = strategy.init(params, jax.random.key(0))
  results = [(v, m, objective(strategy.perturbed(state, (v, m)))) for v, m in strategy.members(state)]
  state, metrics = strategy.update(state, results)

Update rule (Qiu et al., 1/sigma folded into the learning rate ``alpha``)::

  theta <- theta + tx((alpha / N) * sum_i w_i * eps_i),   w_i = z_i * (sigma_{v_i} / sigma_0) * s(v_now - v_i)

``z`` is the shaped fitness of the N results consumed, ``eps_i`` the noise of result i's own
(version, member), regenerated from its key. The factor ``sigma_{v_i}/sigma_0`` makes the step
follow the displacement that was actually evaluated, ``sigma_{v_i} eps_i``; it is 1 under the
constant schedule. ``s`` is the optional staleness weighting (1 by default, as in the paper).
``tx`` is plain SGD by default (exactly the rule above), or Adam, with optional weight decay
(toward zero). ``anchor`` ("l2" / "l1") with ``anchor_decay`` λ > 0 then pulls the stepped
parameters toward the run's starting point θ₀ by ``alpha * λ`` (``jaxes.es.anchor``), which
``update`` then takes as its ``initial`` argument.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jaxes.es import anchor as anchoring
from jaxes.es import noise, noiser, schedules, shaping, update
from jaxes.errors import OptionError

MODES = ("full", "lowrank")
OPTIMIZERS = ("sgd", "adam")
NONFINITE = ("error", "exclude")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["params", "opt_state", "key", "version"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ESState:
  """Checkpointable ES state. ``key`` is the run key's raw uint32 data; ``version`` the number of
  updates applied (a Python int; restored checkpoints may hold it as a 0-d array)."""
  params: Any
  opt_state: Any
  key: jax.Array
  version: int

  @property
  def run_key(self) -> jax.Array:
    return jax.random.wrap_key_data(self.key)


def _key_data(key: jax.Array) -> jax.Array:
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  if key.dtype != jnp.uint32:
    raise ValueError(f"key must be a jax.random.key or a raw uint32 PRNGKey, got dtype {key.dtype}")
  return key


@functools.lru_cache(maxsize=32)
def _named_optimizer(name: str, learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
  """The optax transformation a string option names; cached so equal settings share one object
  (and so one compile of the update)."""
  if name == "adam":
    return optax.adamw(learning_rate, weight_decay=weight_decay)
  return optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(learning_rate))


@functools.lru_cache(maxsize=32)
def _compiled(cfg: noise.NoiseConfig, tx: optax.GradientTransformation):
  """Jitted perturbation and noiser builder, shared by strategies with the same noise
  configuration and optimizer object."""
  return (jax.jit(functools.partial(update.perturb, cfg=cfg)),
          jax.jit(functools.partial(noiser.build, cfg=cfg)))


@functools.lru_cache(maxsize=32)
def _compiled_update(cfg: noise.NoiseConfig, tx: optax.GradientTransformation, layout,
                     anchor: str = "none", anchor_step: float = 0.0):
  """The jitted update for one layout of ``(params, opt_state)`` (``(treedef, shardings)``, or
  None for unplaced arrays): its new params and optimizer state keep their inputs' shardings. Left
  to itself XLA's propagation may choose otherwise: for Qwen2.5-7B on 8xH100 the GPU compiler
  replicated the new parameters (14.2 GiB per device more than the tensor-sharded ones)."""
  out = None
  if layout is not None:
    treedef, shardings = layout
    out = (*jax.tree.unflatten(treedef, shardings), None)
  return jax.jit(functools.partial(update.apply, cfg=cfg, tx=tx, anchor=anchor,
                                   anchor_step=anchor_step), out_shardings=out)


def _layout(params, opt_state):
  """``(treedef, shardings)`` of the update's state where it is placed on a mesh (arrays or
  ShapeDtypeStructs with NamedShardings; a leaf off the mesh, such as an optimizer's step count
  made on one device, is left to the compiler: None), else None."""
  leaves, treedef = jax.tree.flatten((params, opt_state))
  shardings = tuple(x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None
                    for x in leaves)
  return None if all(sh is None for sh in shardings) else (treedef, shardings)


Shaping = Callable[[np.ndarray], np.ndarray]
SigmaSchedule = Callable[[Any], Any]


@dataclasses.dataclass
class Strategy:
  """Options are objects or, as sugar for configs, names:

  * ``shaping``: ``"zscore"`` / ``"centered_rank"`` or any ``fitness[N] -> weights[N]`` function
    (host side, NumPy);
  * ``sigma_schedule``: ``"constant"`` / ``"cosine"`` (with ``sigma_final``, ``schedule_steps``) or
    any ``version -> sigma`` function that works on Python ints and on jnp arrays;
  * ``optimizer``: ``"sgd"`` / ``"adam"`` (built from ``learning_rate``, ``weight_decay``) or any
    ``optax.GradientTransformation``, which then carries its own learning rate;
  * ``anchor``: ``"none"`` / ``"l2"`` / ``"l1"`` decay toward θ₀ with ``anchor_decay`` λ (needs a
    named optimizer: the pull's step is ``learning_rate * λ``; λ = 0 is no anchor).

  A strategy holds no run state: the run key lives in ``ESState``, and every call takes the state
  (or its ``run_key``), so one strategy serves any number of runs.
  """
  population: int
  sigma: float
  learning_rate: float | None = None
  mode: str = "full"
  rank: int = 1
  antithetic: bool = True
  shaping: str | Shaping = "zscore"
  sigma_schedule: str | SigmaSchedule = "constant"
  sigma_final: float | None = None
  schedule_steps: int | None = None
  optimizer: str | optax.GradientTransformation = "sgd"
  weight_decay: float = 0.0
  perturb_vectors: bool = True
  frozen: Sequence[str] = ()
  nonfinite: str = "error"
  staleness_weighting: float | Callable[[int], float] | None = None
  scanned: tuple[str, ...] = ("layers",)
  anchor: str = "none"
  anchor_decay: float = 0.0

  def __post_init__(self):
    if int(self.population) < 1:
      raise OptionError("population", f"must be >= 1, got {self.population!r}")
    if self.antithetic and self.population % 2:
      raise OptionError("population", f"must be even with antithetic=True, got {self.population}")
    if self.mode not in MODES:
      raise OptionError("mode", f"must be one of {MODES}, got {self.mode!r}")
    if int(self.rank) < 1:
      raise OptionError("rank", f"must be >= 1, got {self.rank!r}")
    if not callable(self.shaping) and self.shaping not in shaping.SHAPINGS:
      raise OptionError("shaping", f"must be one of {shaping.SHAPINGS} or a function, got {self.shaping!r}")
    if callable(self.sigma_schedule):
      if not self.sigma > 0:
        raise OptionError("sigma", f"must be > 0, got {self.sigma!r}")
    else:
      schedules.validate(self.sigma_schedule, self.sigma, self.sigma_final, self.schedule_steps)
    if isinstance(self.optimizer, optax.GradientTransformation):
      if self.learning_rate is not None or self.weight_decay:
        raise OptionError("learning_rate", "must be unset (and weight_decay 0) when optimizer is an "
                          "optax transformation (it carries its own)",
                          "learning_rate / weight_decay must be unset when optimizer is an optax "
                          "transformation (it carries its own)")
      tx = self.optimizer
      plain_sgd = False   # an opaque transformation: its update is not known to be a plain step
    else:
      if self.optimizer not in OPTIMIZERS:
        raise OptionError("optimizer", f"must be one of {OPTIMIZERS} or an optax.GradientTransformation, "
                         f"got {self.optimizer!r}")
      if self.learning_rate is None or not self.learning_rate > 0:
        raise OptionError("learning_rate", f"must be > 0, got {self.learning_rate!r}")
      if not self.weight_decay >= 0:
        raise OptionError("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
      tx = _named_optimizer(self.optimizer, float(self.learning_rate), float(self.weight_decay))
      plain_sgd = self.optimizer == "sgd" and self.weight_decay == 0
    anchoring.validate(self.anchor, self.anchor_decay)
    if self.anchor != "none" and isinstance(self.optimizer, optax.GradientTransformation):
      raise OptionError("anchor", "needs optimizer 'sgd' or 'adam' (its step is learning_rate * "
                        "anchor_decay); an optax transformation carries no known learning rate")
    if self.nonfinite not in NONFINITE:
      raise OptionError("nonfinite", f"must be one of {NONFINITE}, got {self.nonfinite!r}")
    sw = self.staleness_weighting
    if not (sw is None or callable(sw) or (isinstance(sw, (int, float)) and 0 < sw <= 1)):
      raise OptionError("staleness_weighting", "must be None, a decay factor in (0, 1] (weight "
                        f"gamma**staleness) or a callable staleness -> weight, got {sw!r}")
    self.scanned = tuple(self.scanned)
    self.frozen = tuple(self.frozen)
    for pattern in self.frozen:
      try:
        re.compile(pattern)
      except re.error as err:
        raise OptionError("frozen", f"{pattern!r} is not a regular expression ({err})",
                          f"frozen: {pattern!r} is not a regular expression ({err})") from err
    self._cfg = noise.NoiseConfig(self.mode, int(self.rank), bool(self.antithetic),
                                  bool(self.perturb_vectors), self.scanned, self.frozen)
    self._tx = tx
    # theta_{v+1} - theta_v is the scaled noise sum itself only for an SGD this strategy built,
    # without weight decay or anchor (no momentum, no state): then it is low-rank wherever the
    # noise is.
    self._plain_sgd = plain_sgd and not self.anchored
    self._perturb, self._build_noiser = _compiled(self._cfg, tx)

  @property
  def noise_config(self) -> noise.NoiseConfig:
    return self._cfg

  @property
  def anchored(self) -> bool:
    """True when ``update`` pulls toward θ₀ (an anchor with λ > 0) and so needs ``initial``."""
    return self.anchor != "none" and self.anchor_decay > 0

  @property
  def tx(self) -> optax.GradientTransformation:
    """The optax transformation ``update`` steps with (built from ``optimizer``, or it)."""
    return self._tx

  def sigma_at(self, version):
    """Sigma of members of ``version`` (Python float for an int, jnp float32 for arrays)."""
    if callable(self.sigma_schedule):
      return self.sigma_schedule(version)
    return schedules.sigma_at(version, self.sigma_schedule, self.sigma, self.sigma_final,
                              self.schedule_steps)

  def leaf_specs(self, params) -> list[noise.LeafSpec]:
    """How each leaf is perturbed (name, kind, stacked) — for inspection and docs."""
    return noise.plan(params, self._cfg)

  # -- API -----------------------------------------------------------------------------------
  def init(self, params, key: jax.Array) -> ESState:
    noise.plan(params, self._cfg)  # fail early on unusable parameter trees
    opt_state = self._tx.init(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params))
    return ESState(params, opt_state, _key_data(key), 0)

  def members(self, state: ESState) -> list[tuple[int, int]]:
    version = int(state.version)
    return [(version, m) for m in range(self.population)]

  def perturbed(self, state: ESState, member: tuple[int, int]):
    """``state.params + sigma_v * sign_m * eps(v, m)``, same pytree and dtypes as the params.

    ``v`` may be any version <= ``state.version``: its key and sigma are used with
    ``state.params`` as the base (pass the state of version v to rebuild that member exactly).
    Member -1 means unperturbed.
    """
    version, m = (int(x) for x in member)
    self._check_member(state, version, m, allow_unperturbed=True)
    if m < 0:
      return state.params
    return self._perturb(state.params, state.run_key, jnp.int32(version), jnp.int32(m),
                         jnp.float32(self.sigma_at(version)))

  def update(self, state: ESState, results: Sequence[tuple[int, int, float]], initial=None
             ) -> tuple[ESState, dict]:
    """Consume ``(version, member, fitness)`` results of any versions <= ``state.version``.
    ``initial``: θ₀, the parameters the anchor pulls toward (required when ``anchored``).

    Returns the next state (version + 1, also when the step is zero) and metrics: ``version``,
    ``num_results``, ``excluded`` (non-finite fitness dropped under ``nonfinite="exclude"``),
    ``fitness_mean/std/min/max``, ``staleness_hist`` (count per staleness 0..max),
    ``staleness_mean``, ``staleness_max``, ``sigma`` (of the new version), ``update_norm`` (L2 norm
    of the applied change, float32) and ``zero_step`` (all weights zero: params unchanged).
    """
    return self.update_with_cohort(state, results, initial)[:2]

  def update_with_cohort(self, state: ESState, results: Sequence[tuple[int, int, float]], initial=None
                         ) -> tuple[ESState, dict, tuple]:
    """``update``'s state and metrics, and ``cohort(state, results)``: the keys and weights it
    stepped along, checked and weighed once."""
    v_now = int(state.version)
    kept, bad, staleness, keyed, n = self._cohort(state, results)
    fitness = np.array([r[2] for r in kept], np.float64)
    new_params, new_opt, norm = self._apply(state)(
        state.params, state.opt_state, state.run_key, *(jnp.asarray(x) for x in keyed[:3]),
        jnp.int32(n), initial=self._initial(initial))
    new_state = ESState(new_params, new_opt, state.key, v_now + 1)
    hist = np.bincount(staleness, minlength=1) if n else np.zeros(1, np.int64)
    metrics = {
        "version": v_now + 1,
        "num_results": n,
        "excluded": len(bad),
        "fitness_mean": float(fitness.mean()) if n else float("nan"),
        "fitness_std": float(fitness.std()) if n else float("nan"),
        "fitness_min": float(fitness.min()) if n else float("nan"),
        "fitness_max": float(fitness.max()) if n else float("nan"),
        "staleness_hist": [int(c) for c in hist],
        "staleness_mean": float(staleness.mean()) if n else 0.0,
        "staleness_max": int(staleness.max()) if n else 0,
        "sigma": float(self.sigma_at(v_now + 1)),
        "update_norm": float(norm),
        "zero_step": bool(not np.any(keyed[2] != 0)),
    }
    return new_state, metrics, (*keyed, np.int32(n))

  def _apply(self, state: ESState):
    """The jitted step ``update`` runs for ``state``'s layout."""
    if not self.anchored:
      return _compiled_update(self._cfg, self._tx, _layout(state.params, state.opt_state))
    return _compiled_update(self._cfg, self._tx, _layout(state.params, state.opt_state),
                            self.anchor, float(self.learning_rate) * float(self.anchor_decay))

  def _initial(self, initial):
    """What the jitted update takes as θ₀: ``initial`` when anchored (then required), else None."""
    if not self.anchored:
      return None
    if initial is None:
      raise ValueError(f"anchor={self.anchor!r} with anchor_decay={self.anchor_decay}: update needs "
                       "initial (θ₀, the parameters of version 0)")
    return initial

  def lower_update(self, state: ESState, initial=None) -> jax.stages.Lowered:
    """The program ``update`` runs, lowered for ``state`` (arrays, or ShapeDtypeStructs in their
    shardings) and a cohort of up to ``population`` noise keys, its arguments given as ``update``
    gives them: compiling it writes the persistent-cache entry the first such update reads."""
    key = state.key
    run_key = (state.run_key if isinstance(key, jax.Array) else jax.ShapeDtypeStruct(
        (), jax.eval_shape(jax.random.wrap_key_data, key).dtype, sharding=key.sharding))
    n = self._padded_size(self.population)
    keys = jax.ShapeDtypeStruct((n,), jnp.int32)   # host arrays, as ``update`` passes them
    return self._apply(state).lower(state.params, state.opt_state, run_key, keys, keys,
                             jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32),
                             initial=self._initial(initial))

  def member_noiser(self, params, versions, members, row_group, *, run_key: jax.Array
                    ) -> noiser.PopulationNoiser:
    """Noiser for a batch whose row b is member ``members[row_group[b]]`` of version
    ``versions[row_group[b]]`` (member -1: unperturbed), keyed by the run's ``state.run_key``.
    Jittable; see ``jaxes.es.noiser`` for the memory of each mode."""
    versions = jnp.asarray(versions, jnp.int32)
    return self._build_noiser(params, run_key, versions, members, row_group, self.sigma_at(versions))

  def engine_noiser(self, run_key: jax.Array):
    """``make_noiser(params, versions, members, row_group)`` for the rollout engine: each row's
    member of this strategy under ``run_key`` (``member_noiser``)."""
    def make_noiser(params, versions, members, row_group):
      return self.member_noiser(params, versions, members, row_group, run_key=run_key)
    return make_noiser

  # -- a version as its predecessor plus a low-rank step (the rollout engine's merged calls) --
  @property
  def steps_are_lowrank(self) -> bool:
    """True when ``update``'s change to every low-rank matrix is itself low-rank and regenerable
    from the cohort: low-rank mode and an SGD this strategy built from ``optimizer="sgd"``
    without weight decay or anchor (any other transformation, Adam above all, is not)."""
    return self.mode == "lowrank" and self._plain_sgd

  def cohort(self, state: ESState, results: Sequence[tuple[int, int, float]]):
    """``(versions, members, weights, count)``, host arrays: the noise keys and weights that
    ``update(state, results)`` steps along (the argument of ``version_step``'s function)."""
    _, _, _, keyed, n = self._cohort(state, results)
    return (*keyed, np.int32(n))

  def version_step(self, params, run_key: jax.Array):
    """``step(versions, members, weights, count) -> {name: (a, b)}`` (jittable), the change
    ``update`` makes to each low-rank matrix as factors, ``a @ b.T`` (``update.lowrank_step``),
    for a cohort as ``cohort`` returns it, or None when the change is not low-rank: not
    ``steps_are_lowrank``, or a matrix is perturbed full-rank. ``params`` gives the shapes."""
    specs = tuple(noise.plan(params, self._cfg))
    if not self.steps_are_lowrank or any(s.kind == "full" and not noiser.is_vector(s) for s in specs):
      return None
    return functools.partial(update.lowrank_step, specs, run_key, cfg=self._cfg,
                             learning_rate=float(self.learning_rate))

  # -- helpers -------------------------------------------------------------------------------
  def _cohort(self, state: ESState, results):
    """The checked results of an update, as ``(kept, bad, staleness, keyed, n)``: ``keyed`` the
    (versions, members, weights) of the noise keys, float32 weights, padded with zero weights to
    ``_padded_size`` (one compiled shape), and ``n`` the results counted."""
    v_now = int(state.version)
    kept, bad, seen = [], [], set()
    for i, res in enumerate(results):
      try:
        version, m, fitness = int(res[0]), int(res[1]), float(res[2])
      except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"result {i} must be (version, member, fitness), got {res!r}") from e
      self._check_member(state, version, m, allow_unperturbed=False)
      if (version, m) in seen:
        raise ValueError(f"duplicate result for (version={version}, member={m})")
      seen.add((version, m))
      (kept if math.isfinite(fitness) else bad).append((version, m, fitness))
    if bad and self.nonfinite == "error":
      raise ValueError(f"non-finite fitness for (version, member, fitness) {bad[:8]}"
                       f"{' ...' if len(bad) > 8 else ''}; set nonfinite='exclude' to drop them")

    n = len(kept)
    versions = np.array([r[0] for r in kept], np.int32)
    members = np.array([r[1] for r in kept], np.int32)
    fitness = np.array([r[2] for r in kept], np.float64)
    staleness = v_now - versions
    weights = (np.asarray(self.shaping(fitness), np.float64) if callable(self.shaping)
               else shaping.shape(fitness, self.shaping))
    weights = weights * np.array([self.sigma_at(int(v)) for v in versions]) / self.sigma
    weights = weights * self._staleness_weights(staleness)

    keyed = update.combine_pairs(versions, members, weights, self.antithetic)
    pad = self._padded_size(len(keyed[0])) - len(keyed[0])
    keyed = tuple(np.pad(x, (0, pad)) for x in keyed)
    return kept, bad, staleness, (keyed[0], keyed[1], keyed[2].astype(np.float32)), n

  def _check_member(self, state: ESState, version: int, m: int, allow_unperturbed: bool) -> None:
    if not 0 <= version <= int(state.version):
      raise ValueError(f"version {version} is outside [0, {int(state.version)}] (the state's version)")
    # Ids beyond `population` are legal: an async controller keeps issuing fresh members of the
    # newest version while older ones are still running; a member's noise depends only on its id.
    low = -1 if allow_unperturbed else 0
    if m < low:
      raise ValueError(f"member {m} must be >= {low}")

  def _staleness_weights(self, staleness: np.ndarray) -> np.ndarray:
    sw = self.staleness_weighting
    if sw is None:
      return np.ones(staleness.shape)
    if callable(sw):
      return np.array([float(sw(int(s))) for s in staleness])
    return float(sw) ** staleness.astype(np.float64)

  def _padded_size(self, n: int) -> int:
    """Pad the number of noise keys to a multiple of ``population``: any cohort of up to N
    results (merged pairs or not, any mix of versions) then has one compiled shape. Padding is
    free: zero-weight entries skip noise generation."""
    return max(1, -(-n // self.population)) * self.population

"""What each engine call decodes with: its versions' parameters and, for ES, every row's noise.

The engine (``jaxes.rollout.engine``) runs a call over some rows of one or more live versions and
asks its bank what the call decodes with (``step_program.Decoding``): the parameters, placed in
the rule table's shardings once per version, and the rows' noiser; and, for rows of several
versions, the low-rank steps between them (``step_program.Steps``). The algorithm picks the bank (``Algorithm.build_engine``):

``PolicyBank``: every row decodes its version's parameters as they are (GRPO, SAO, evaluation).

``ESPolicyBank``: a slot's policy is its member's perturbation of its version's parameters,
applied in-graph by the noiser (``make_noiser``), which the bank keeps per version and rebuilds
only when a call has a row started since it was built. Two more ways of decoding:

* Member slices (``member_slices=True``, full-rank noise): every data shard's slots hold episodes
  of one (version, member) at a time (the scheduler refuses others), and the noiser has one group
  per shard, laid out with it (``PopulationNoiser.in_slices`` / ``slice_shardings``): one
  perturbed weight copy per device instead of one per slot.
* All live versions in one call (``version_steps=``, see ``VersionSteps``): when version v is
  version v-1 plus a low-rank step (ES in low-rank mode with plain SGD: the update's change to each
  matrix is ``a @ b.T``, regenerated from the cohort's keys and weights, ``add_step``), rows of
  versions ``base ... base + max_steps`` run in one call on the oldest live version's parameters:
  each matmul is the base's, plus the steps the row's version has on top of it (``(x @ a_k) @
  b_k.T``, shared by the rows), plus the row's own perturbation; biases and norm gains, tiny, are
  taken per row from the row's own version's parameters (``with_vectors_of``). When the oldest
  version retires the base moves to the next one the caller passes. Versions without their steps,
  or further apart, run in calls of their own. The programs with steps compile apart from those
  without (at most twice the step programs), so a step with one live version runs those unchanged.

A bank serves one engine: the engine binds it to its placement and scheduler when it is built.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxes import sharding
from jaxes.rollout.placement import Placement
from jaxes.rollout.scheduler import FREE, Scheduler, Slot
from jaxes.rollout.step_program import Decoding, Steps


@dataclasses.dataclass(frozen=True)
class VersionSteps:
  """How the bank learns that a version is its predecessor plus a low-rank step.

  ``make(versions[N], members[N], weights[N], count) -> {name: (a, b)}`` (jittable): the change
  to each low-rank matrix, ``a [(L,) in, R] @ b [(L,) out, R].T``, of the update that consumed the
  cohort (``jaxes.es.Strategy.version_step``; its argument is ``Strategy.cohort``'s). ``cohort``:
  N, the cohort's padded size (one compiled shape). ``max_steps``: the most steps a call adds on
  top of its base (static: each is a slot of the compiled programs; an async run's
  ``max_staleness``)."""
  make: Callable
  cohort: int
  max_steps: int = 1

  def __post_init__(self):
    if int(self.cohort) < 1 or int(self.max_steps) < 1:
      raise ValueError(f"VersionSteps needs cohort >= 1 and max_steps >= 1, got cohort="
                       f"{self.cohort}, max_steps={self.max_steps}")


class PolicyBank:
  """Every row decodes its version's parameters, unperturbed. ``params_by_version`` (given to
  ``decoding``) holds each version as an ``nnx.State`` like ``nnx.split``'s, placed in the rule
  table's shardings if it is not."""
  member_slices = False
  version_steps: VersionSteps | None = None
  noiser_shardings = abstract_noiser = None

  def __init__(self):
    self._placement: Placement | None = None
    self._in_place: dict[int, tuple] = {}  # version -> (params as given, params in place)

  @property
  def max_steps(self) -> int | None:
    """The most low-rank steps a call adds on top of its base; None: a call per version."""
    return None if self.version_steps is None else int(self.version_steps.max_steps)

  def bind(self, placement: Placement, abstract_params, scheduler: Scheduler) -> None:
    """Called once by the engine this bank serves."""
    if self._placement is not None:
      raise ValueError("a policy bank serves one engine; build another for a second engine")
    self._placement, self.abstract_params, self._scheduler = placement, abstract_params, scheduler

  @property
  def stepped(self) -> Any:
    """The versions whose step from their predecessor the bank holds (``Scheduler.groups``)."""
    return ()

  def place(self, version: int, params):
    """``params`` in the rule table's shardings, moved once per version (a new object is placed
    again): a no-op when they already are there, e.g. loaded by ``hf.load(mesh=...)``."""
    held = self._in_place.get(version)
    if held is None or held[0] is not params:
      live = self._scheduler.live_versions()
      self._in_place = {v: p for v, p in self._in_place.items() if v in live}
      self._in_place[version] = held = (
          params, jax.device_put(params, self._placement.param_shardings))
    return held[1]

  def decoding(self, group: tuple, rows: list[Slot],
               params_by_version: dict) -> tuple[Decoding, Steps | None]:
    """What a call over ``rows`` of the versions ``group`` (the first the base) decodes with, and
    the steps its rows of newer versions add (None: all of the base's version)."""
    return Decoding(self.place(group[0], params_by_version[group[0]])), None

  def add_step(self, version: int, versions, members, weights, count) -> bool:
    """Register ``version`` as ``version - 1`` plus a low-rank step (``ESPolicyBank.add_step``).
    Here nothing is registered (every row decodes its own version's parameters): False."""
    return False

  def retire(self, params_by_version: dict) -> None:
    """Before a step's calls: drop what versions no slot holds, or older than any passed, need."""

  def shardings(self) -> Decoding:
    return Decoding(self._placement.param_shardings)

  def abstract(self) -> Decoding:
    return Decoding(self.abstract_params)

  def lowerings(self) -> dict[str, Callable[[], Any]]:
    """The bank's own programs (``Engine.lowerings``), each lowered when called."""
    return {}

  def jitted(self) -> list:
    """The bank's jitted functions (``Engine.compilations`` counts their programs)."""
    return []

  def abstract_version_steps(self) -> list:
    """A bound on the low-rank steps held at once (abstract, for sizing); empty without steps."""
    return []


def _stack_steps(*steps):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *steps)


def _merge_noisers(base, others, owner):
  return base.with_vectors_of(others, owner)


def _in_slices(make_noiser, *args):
  return make_noiser(*args).in_slices()


class ESPolicyBank(PolicyBank):
  """``make_noiser(params, versions[B], members[B], row_group[B]) -> Noiser`` (jittable; with
  compaction it needs ``select_rows``, as ``jaxes.es.noiser.PopulationNoiser`` has).
  ``version_steps``: run rows of consecutive versions in one call (``VersionSteps``, ``add_step``;
  the noiser then needs ``with_steps`` and ``with_vectors_of``); None: one call per version.
  ``member_slices``: one (version, member) per data shard (the module docstring)."""

  def __init__(self, make_noiser: Callable, *, version_steps: VersionSteps | None = None,
               member_slices: bool = False):
    super().__init__()
    if member_slices and version_steps is not None:
      raise ValueError("member_slices needs no version_steps (full-rank members' weights are not "
                       "a low-rank step apart)")
    self._make_noiser_fn, self.version_steps, self.member_slices = (
        make_noiser, version_steps, member_slices)
    # version, or a call's versions (a tuple) -> (versions [B], members [B] built for, the
    # placed params built from, noiser)
    self._noisers: dict[Any, tuple] = {}
    self._slice_noisers: dict[int, tuple] = {}  # member_slices: version -> (members [D], noiser)
    self._steps: dict[int, Any] = {}     # version v -> the low-rank step from v - 1 to v
    self._stacked: dict[tuple, Any] = {}  # the steps a call adds, stacked

  def bind(self, placement: Placement, abstract_params, scheduler: Scheduler) -> None:
    super().bind(placement, abstract_params, scheduler)
    rows, B, D = placement.rows, placement.num_slots, placement.shards
    make_noiser = self._make_noiser_fn
    slot_ids = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rows)
    # Member slices: versions and members per data shard [D], row_group per slot [B].
    groups = (jax.ShapeDtypeStruct((D,), jnp.int32, sharding=rows) if self.member_slices
              else slot_ids)
    self._noiser_args = (groups, groups, slot_ids)
    if self.member_slices:
      make_noiser = functools.partial(_in_slices, make_noiser)
    shapes = jax.eval_shape(make_noiser, abstract_params, *self._noiser_args)
    self.noiser_shardings = (shapes.slice_shardings(placement.param_shardings) if self.member_slices
                             else jax.tree.map(self._leaf_sharding, shapes))
    self.abstract_noiser = sharding.abstract(shapes, self.noiser_shardings)
    self._make_noiser = jax.jit(make_noiser, out_shardings=self.noiser_shardings,
                                in_shardings=(placement.param_shardings, rows, rows, rows))
    if self.version_steps is not None:
      self._bind_version_steps()

  def _leaf_sharding(self, leaf) -> NamedSharding:
    """Noiser leaves with one entry per slot live with their rows (over ``data``); anything else
    (a full-rank member's weights) is replicated."""
    per_row = leaf.ndim >= 1 and leaf.shape[0] == self._placement.num_slots
    return NamedSharding(self._placement.mesh, PartitionSpec("data" if per_row else None))

  def _bind_version_steps(self) -> None:
    vs, replicated = self.version_steps, self._placement.replicated
    K, N = int(vs.max_steps), int(vs.cohort)
    self._cohort_shapes = (jax.ShapeDtypeStruct((N,), jnp.int32, sharding=replicated),) * 2 + (
        jax.ShapeDtypeStruct((N,), jnp.float32, sharding=replicated),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
    one = jax.eval_shape(vs.make, *self._cohort_shapes)
    # Steps are shared by every row: replicated, as the noiser's leaves without a per-slot axis
    # are (``_leaf_sharding``); their [B, K] row weights live with the rows.
    self._step_shapes = sharding.abstract(one, jax.tree.map(lambda _: replicated, one))
    self._stacked_shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((K,) + x.shape, x.dtype, sharding=replicated), one)
    self._make_step = jax.jit(vs.make, in_shardings=replicated, out_shardings=replicated)
    self._zero_step = None
    self._stack = jax.jit(_stack_steps, out_shardings=replicated)
    self._merge = jax.jit(_merge_noisers, in_shardings=(
        self.noiser_shardings, (self.noiser_shardings,) * K, self._placement.rows),
                          out_shardings=self.noiser_shardings)

  @property
  def stepped(self) -> Any:
    return self._steps

  def shardings(self) -> Decoding:
    return Decoding(self._placement.param_shardings, self.noiser_shardings)

  def abstract(self) -> Decoding:
    return Decoding(self.abstract_params, self.abstract_noiser)

  def step_shardings(self) -> Steps:
    """``Steps``' shardings (with ``version_steps``): the factors replicated, the rows' with them."""
    return Steps(self._placement.replicated, self._placement.rows)

  def abstract_steps(self) -> Steps:
    rows = jax.ShapeDtypeStruct((self._placement.num_slots, self.max_steps), jnp.float32,
                                sharding=self._placement.rows)
    return Steps(self._stacked_shapes, rows)

  def lowerings(self) -> dict[str, Callable[[], Any]]:
    out = {"noiser": functools.partial(self._make_noiser.lower, self.abstract_params,
                                       *self._noiser_args)}
    if self.version_steps is None:
      return out
    K = self.max_steps
    out["version_step"] = functools.partial(self._make_step.lower, *self._cohort_shapes)
    out["stack_steps"] = functools.partial(self._stack.lower, *(self._step_shapes,) * K)
    out["merge_noisers"] = functools.partial(self._merge.lower, self.abstract_noiser,
                                             (self.abstract_noiser,) * K, self._noiser_args[2])
    return out

  def jitted(self) -> list:
    if self.version_steps is None:
      return [self._make_noiser]
    return [self._make_noiser, self._make_step, self._stack, self._merge]

  def abstract_version_steps(self) -> list:
    """The registered steps of the ``max_steps + 1`` versions after the oldest live one, the zero
    step that pads a stack, and the stacks of the calls the oldest base can make (``max_steps``
    of them, ``max_steps`` steps each)."""
    if self.version_steps is None:
      return []
    K = self.max_steps
    return [self._step_shapes] * (K + 2) + [self._stacked_shapes] * K

  def add_step(self, version: int, versions, members, weights, count) -> bool:
    """Register that ``version`` is ``version - 1`` plus the low-rank step of the update that
    consumed this cohort (host arrays, ``Strategy.cohort``): rows of ``version`` may then run in
    a call based on an older live version. False (nothing registered; such rows keep calls of
    their own) without ``version_steps``, abstractly, or when the cohort is not
    ``VersionSteps.cohort`` long."""
    vs = self.version_steps
    if vs is None or self._placement.abstract or len(versions) != int(vs.cohort):
      return False
    cohort = (np.asarray(versions, np.int32), np.asarray(members, np.int32),
              np.asarray(weights, np.float32), np.asarray(count, np.int32))
    self._steps[int(version)] = self._make_step(*self._placement.everywhere(*cohort))
    return True

  def retire(self, params_by_version: dict) -> None:
    live = self._scheduler.live_versions()   # noisers of versions no slot holds go
    self._noisers = {k: x for k, x in self._noisers.items()
                     if set(k if isinstance(k, tuple) else (k,)) <= live}
    if self._steps and params_by_version:   # steps up to the oldest version passed are done with
      oldest = min(params_by_version)
      self._steps = {v: x for v, x in self._steps.items() if v > oldest}
      self._stacked = {k: x for k, x in self._stacked.items() if k[0] >= oldest}

  def decoding(self, group: tuple, rows: list[Slot],
               params_by_version: dict) -> tuple[Decoding, Steps | None]:
    base = group[0]
    params = self.place(base, params_by_version[base])
    newest = max(s.version for s in rows)
    if newest == base:
      return Decoding(params, self._noiser(base, params, rows)), None
    # Rows of several versions: the base's weights plus each row's steps.
    step_rows = np.zeros((self._placement.num_slots, self.max_steps), np.float32)
    for s in rows:
      step_rows[s.index, :s.version - base] = 1.0
    noiser = self._versions_noiser(base, group, params_by_version, rows)
    return Decoding(params, noiser), Steps(self._stacked_steps(base, newest),
                                           *self._placement.by_rows(step_rows))

  # -- noisers, kept while they fit ---------------------------------------------------------------
  def _assignment(self) -> tuple[np.ndarray, np.ndarray]:
    """Every slot's (noise version, member) as a noiser is built for them (free slots: member
    -1); a row that changed version keeps the noise of the member it was started as."""
    slots = self._scheduler.slots
    return (np.array([s.noise_version for s in slots], np.int32),
            np.array([s.member if s.state != FREE else -1 for s in slots], np.int32))

  def _build(self, params, versions, members, row_group):
    return self._make_noiser(params, *self._placement.by_rows(versions, members, row_group))

  def _held_noiser(self, key, rows: list[Slot], params: tuple):
    """The noiser kept under ``key`` if it was built from ``params`` (the placed weights of the
    call's versions: a full-rank perturbed vector holds its weights) for every row of the call as
    it is now (a row's perturbation depends on its own (version, member) only), else None: a
    slot that started since costs a rebuild only when it joins a call."""
    held = self._noisers.get(key)
    if held is None:
      return None
    versions, members, built_from, noiser = held
    if all(a is b for a, b in zip(built_from, params, strict=True)) and all(
        versions[s.index] == s.noise_version and members[s.index] == s.member for s in rows):
      return noiser
    return None

  def _noiser(self, version: int, params, rows: list[Slot]):
    if self.member_slices:
      return self._slice_noiser(version, params)
    noiser = self._held_noiser(version, rows, (params,))
    if noiser is None:
      versions, members = self._assignment()
      noiser = self._build(params, versions, members, self._slot_ids())
      self._noisers[version] = (versions, members, (params,), noiser)
    return noiser

  def _slot_ids(self) -> np.ndarray:
    return np.arange(self._placement.num_slots, dtype=np.int32)

  def _slice_noiser(self, version: int, params):
    """``version``'s noiser with member slices: group d is the member of data shard d's episodes
    of this version. A shard without any keeps the group it had (its rows are not in this
    version's calls), so the noiser, a model copy per device, is rebuilt only when a shard
    starts another member; the one it replaces is dropped first."""
    want = [m if m is not None and m[0] == version else None
            for m in self._scheduler.slice_members()]
    live = self._scheduler.live_versions()   # noisers of versions no slot holds go (a copy each)
    self._slice_noisers = {v: x for v, x in self._slice_noisers.items() if v in live}
    held = self._slice_noisers.get(version)
    if held is None or any(w is not None and w[1] != h for w, h in zip(want, held[0])):
      members = np.array([w[1] if w is not None else held[0][d] if held else -1
                          for d, w in enumerate(want)], np.int32)
      self._slice_noisers.pop(version, None)
      shards = self._placement.shards
      noiser = self._build(params, np.full(shards, version, np.int32), members,
                           self._slot_ids() // (self._placement.num_slots // shards))
      held = self._slice_noisers[version] = (tuple(int(m) for m in members), noiser)
    return held[1]

  def _versions_noiser(self, base: int, versions: tuple, params_by_version: dict,
                       rows: list[Slot]):
    """The noiser of a call over ``rows`` of ``versions`` (base first): every row's
    perturbation, and its vectors from its own version's noiser (``with_vectors_of``). Rebuilt
    when a row of the call was started since, like the per-version ones; those of the newer
    versions are not kept."""
    placed = tuple(self.place(v, params_by_version[v]) for v in versions)
    merged = self._held_noiser(versions, rows, placed)
    if merged is None:
      noiser = self._noiser(base, placed[0], rows)
      assigned = self._assignment()
      others = [noiser] * self.max_steps
      for v, params in zip(versions[1:], placed[1:]):
        others[v - base - 1] = self._build(params, *assigned, self._slot_ids())
      owner = np.array([s.version - base if s.state != FREE and s.version in versions else 0
                        for s in self._scheduler.slots], np.int32)
      merged = self._merge(noiser, tuple(others), *self._placement.by_rows(owner))
      self._noisers[versions] = (*assigned, placed, merged)
    return merged

  def _stacked_steps(self, base: int, newest: int):
    """Steps ``base + 1 ... newest`` stacked into the K slots of the programs (zeros after)."""
    key = (base, newest)
    if key not in self._stacked:
      if self._zero_step is None:   # a cohort of zero weights: a step of zeros, same program
        N = int(self.version_steps.cohort)
        self._zero_step = self._make_step(*self._placement.everywhere(
            np.zeros(N, np.int32), np.zeros(N, np.int32), np.zeros(N, np.float32), np.int32(1)))
      self._stacked[key] = self._stack(*(
          self._steps[base + k] if base + k <= newest else self._zero_step
          for k in range(1, self.max_steps + 1)))
    return self._stacked[key]

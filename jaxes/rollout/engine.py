"""Slot-based continuous batching over a KV cache, every slot with its own (version, member).

This module is the device-facing part: the cache, the compiled step programs
(``jaxes.rollout.step_program``), the noisers and version steps, and each call's arrays. The
host's side — slots, pages, the prefill hold, version groups, what each row feeds and samples —
is ``jaxes.rollout.scheduler`` (plain Python, no JAX), whose decisions ``step`` turns into calls.

``B`` slots share one cache ``[L, B, S, ...]``. A slot holds one episode: its prompt is prefilled
in chunks of at most ``prefill_chunk`` tokens, then tokens are decoded one per step until
``<|im_end|>`` (or another stop id) or the turn's token budget; the finished turn is handed back
and the slot is *parked* (its cache row kept) while the caller runs the command in a sandbox;
``continue_turn`` closes the assistant turn and queues the observation for prefill, and decoding
resumes.

Each step makes one call per live policy version (per group of versions, below), covering all
of that version's working slots, as one flat buffer of tokens (``jaxes.rollout.step_program``):
decoding rows feed their last token, prefilling rows their next chunk, each token naming its
cache row and its offset in the row (the ragged ``qwen2.Options.token_offsets``). A data
shard's tokens are padded to the smallest of a few token buckets (``Engine.buckets``: a quarter
of the shard's ``B / D`` rows, all of them, all plus a chunk); a call's prefill is cut to fit the
largest (``_pack``), the rest going next call. One program per bucket serves every call — decode
only, prefill only or both — so the shapes are set by the buckets, not by widths x batch sizes.
After the first step each row whose prompt is done decodes on in an on-device loop, up to
``decode_steps`` tokens per call (``jaxes.rollout.decode_loop``), the host reading the sampled
tokens once per call. Attention reads key blocks up to the call's furthest token only (one span,
the whole row; on GPU, where cuDNN takes the whole span, the shortest of three prefixes of the
cache rows that holds every row of the call, ``Engine.spans``). Rows not in the call are
untouched. A slot's policy is its member's perturbation of that version's parameters, applied
in-graph by the noiser (``make_noiser``), rebuilt only when a call has a row started since it
was built.

Compaction's effect (``compact=True``, the default): a call costs its bucket's tokens, so
parked, free and other-version rows cost nothing; each token reads the key blocks of its own
cache row and writes its keys and values into the donated cache in place (``attention.Rows``).
The step compiles ``len(buckets) * len(spans)`` programs for the life of the engine (3 for the
paper config off GPU); ``compact=False`` keeps the largest bucket only.

Prefill coalescing (``prefill_hold=H``, default 8): a new prefill (a prompt at ``start``, an
observation at ``continue_turn``) that would start a call's prefill beside decoding rows waits up
to H steps, so that prefills arriving a few steps apart share the larger bucket they move the
call to instead of each paying for it. It goes at once when nothing else decodes or a row of its
call group is mid-prefill (that call runs anyway), and all of a group's waiting prefills go when
the first has waited H steps or they are as many as the smallest bucket's rows. The decision reads the slots' states
only, never the clock; the same programs run (no new shapes).

All live versions in one call (``version_steps=``, see ``VersionSteps``): when version v is
version v-1 plus a low-rank step (ES in low-rank mode with plain SGD: the update's change to each
matrix is ``a @ b.T``, regenerated from the cohort's keys and weights, ``add_step``), rows of
versions ``base ... base + max_steps`` run in one call on the oldest live version's parameters:
each matmul is the base's, plus the steps the row's version has on top of it (``(x @ a_k) @
b_k.T``, shared by the rows), plus the row's own perturbation; biases and norm gains, tiny, are
taken per row from the row's own version's parameters. When the oldest version retires the base
moves to the next one the caller passes. Versions without their steps, or further apart, run in
calls of their own as above. The programs with steps compile apart from those without (at most
twice the step programs), so a step with one live version runs the programs above unchanged.

Paged KV cache (``page_size=P, num_pages=N``; default None: the dense cache above, whose programs
are unchanged): keys and values live in N pages of P tokens (``qwen2.PagedKVCache``), split over
the ``data`` shards with the slots (shard d's slots use shard d's N / D pages, page ids local to
the shard), and each slot's page table ``[B, max_len / P]`` says which pages hold its tokens; the
host keeps a free-page pool per shard (``jaxes.rollout.pages``) and ships the table to the
devices when it changed. A slot takes its prompt's pages at ``start``, an observation's at
``continue_turn``, and one page whenever a decoded token starts a new page; ``release`` returns
them all. Admission never over-commits: ``start`` of a prompt whose pages are not free now is
refused (``can_start`` says so first, ``free_slots`` leaves out the slots of shards without a
free page), a decoding row that finds no free page ends its turn cut short (``Turn.failure =
PAGES_EXHAUSTED``) and an observation without pages is refused with that reason
(``Slot.failure``): the caller ends such an episode as truncated. Every call reads and writes
through ``attention.Pages`` (per shard, under ``shard_map``), the compacted and version-steps
calls included; the same programs compile as for the dense cache (same names, same count).

Every sampled token comes with its log-prob under the distribution it was drawn from
(``Turn.logprobs``): the behaviour log-probs a policy-gradient learner's importance ratio needs.

On a mesh (``mesh=``; default: one device) every device array is created where it lives: the
cache by a jitted init with ``out_shardings`` from the logical-axis rules (slots over ``data``,
KV heads over ``tensor`` where they divide), the noiser with its rows (over ``data``), and the
step is jitted with explicit in/out shardings, the cache donated and updated in place. With
``abstract=True`` nothing is allocated: the cache is shapes and shardings only and
``programs()`` lowers every program the engine runs, for ``jaxes.preflight`` to compile
(``lowerings()``: the same names, each lowered on demand).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxes import sharding
from jaxes.models import attention, partition, qwen2
from jaxes.rollout import step_program
# The host side's types and states, part of the engine's API (``Engine.slots``, ``step``'s turns).
from jaxes.rollout.scheduler import (DECODE, FREE, PAGES_EXHAUSTED, PARKED, PREFILL,  # noqa: F401
                                     EngineStats, Scheduler, Slot, Turn)

@dataclasses.dataclass(frozen=True)
class VersionSteps:
  """How the engine learns that a version is its predecessor plus a low-rank step.

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


def _stack_steps(*steps):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *steps)


def _merge_noisers(base, others, owner):
  return base.with_vectors_of(others, owner)


def _in_slices(make_noiser, *args):
  return make_noiser(*args).in_slices()


def _own_rows(x: jax.Array, fill) -> np.ndarray:
  """``x`` (rows over ``data``) on the host: whole on one process; on several, the rows of this
  process's shards only (the rest ``fill``), so no process reads, or waits for, another's."""
  if x.is_fully_addressable:
    return np.asarray(x)
  out, seen = np.full(x.shape, fill, x.dtype), set()
  for shard in x.addressable_shards:
    rows = shard.index[0].indices(x.shape[0])
    if rows not in seen:   # a shard's copies on this process's other devices (tensor, fsdp)
      seen.add(rows)
      out[shard.index] = np.asarray(shard.data)
  return out


def _reset_rows(cache: qwen2.KVCache, rows: jax.Array) -> qwen2.KVCache:
  return dataclasses.replace(cache, index=jnp.where(rows, 0, cache.index),
                             valid=jnp.where(rows[:, None], False, cache.valid))


@functools.lru_cache(maxsize=None)
def _step_function(graphdef, layout: tuple, decode_steps: int, stop_ids: tuple, paged: bool):
  """``step_program.call`` with an engine configuration's static arguments bound, one function
  object per configuration: jit objects over the same function and equal shardings share their
  traced, lowered and compiled programs, so a second engine of the same configuration (a
  trainer rebuilt on resume, an evaluation engine, a reference engine in a test) traces and
  compiles nothing again. Graph definitions and meshes compare by value."""
  return functools.partial(step_program.call, graphdef, layout, decode_steps, stop_ids, paged)


class Engine:
  """``make_noiser(params, versions[B], members[B], row_group[B]) -> Noiser`` (jittable) or None
  for plain inference. ``params_by_version`` passed to ``step`` must hold every slot's version,
  each an ``nnx.State`` like ``nnx.split``'s (placed in the rule table's shardings if it is not).
  ``mesh``: a (data, fsdp, tensor) mesh (``jaxes.sharding.make_mesh``) whose ``data`` size divides
  ``num_slots``; None = the first device. ``abstract``: allocate nothing (see ``programs``).
  ``compact``: run a call on its working rows only when they fit a smaller compiled batch (see
  the module docstring; the noiser then needs ``select_rows``, as
  ``jaxes.es.noiser.PopulationNoiser`` has); False: every call runs all B rows.
  ``version_steps``: run rows of consecutive versions in one call (``VersionSteps``, ``add_step``;
  the noiser then needs ``with_steps`` and ``with_vectors_of``); None: one call per version.
  ``page_size``/``num_pages``: a paged KV cache of ``num_pages`` pages of ``page_size`` tokens,
  split over the ``data`` shards with the slots (see the module docstring); None: one dense
  ``max_len`` row per slot. ``member_slices`` (full-rank noise): every data shard's slots hold
  episodes of one (version, member) at a time, and the noiser has one group per shard, laid out
  with it (``PopulationNoiser.in_slices`` / ``slice_shardings``): one perturbed weight copy per
  device instead of one per slot; ``start`` refuses a slot whose shard runs another member.
  ``prefill_hold``: steps a new prefill (a prompt, an observation) may wait while other rows
  decode, so that prefills arriving a few steps apart share one call (``_held``); 0: none waits.
  ``prefill_tokens``: prefill tokens per data shard a call may hold beside its decode tokens
  (the largest bucket; default ``prefill_chunk``), a row still taking at most a chunk."""

  def __init__(self, graphdef, model_config: qwen2.Qwen2Config, *, num_slots: int, max_len: int,
               prefill_chunk: int, max_new_tokens: int, stop_ids, im_end_id: int,
               make_noiser: Callable | None = None, seed: int = 0, mesh: Mesh | None = None,
               rules=sharding.LOGICAL_RULES, abstract: bool = False, compact: bool = True,
               version_steps: VersionSteps | None = None, page_size: int | None = None,
               num_pages: int | None = None, member_slices: bool = False, prefill_hold: int = 8,
               decode_steps: int = 8, prefill_tokens: int | None = None):
    if max_len <= max_new_tokens:
      raise ValueError(f"max_len={max_len} must exceed max_new_tokens={max_new_tokens}")
    if (page_size is None) != (num_pages is None):
      raise ValueError(f"page_size and num_pages go together, got page_size={page_size}, "
                       f"num_pages={num_pages}")
    self.mesh = sharding.make_mesh(devices=jax.devices()[:1]) if mesh is None else mesh
    data = self.mesh.shape["data"]
    if num_slots % data:
      raise ValueError(f"num_slots={num_slots} is not divisible by the mesh's data={data}: "
                       f"every data shard must hold the same number of slots")
    self.num_slots, self.max_len, self.chunk = num_slots, max_len, prefill_chunk
    if prefill_hold < 0:
      raise ValueError(f"prefill_hold must be >= 0, got {prefill_hold}")
    self.prefill_hold = int(prefill_hold)
    if decode_steps < 1:
      raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    self.decode_steps = int(decode_steps)
    self.shards, self.compact = data, compact
    per_shard = num_slots // data
    # Token buckets: the flat tokens per data shard an engine call holds, padded up to the
    # smallest that fits (one compiled program each). The largest holds every row's decode
    # token plus a full prefill chunk (a call's prefill is cut to fit, the rest goes next call);
    # the full rows and a quarter of them serve decode-only calls (compaction's effect: below a
    # quarter the weights, read once per call whatever its tokens, are most of an accelerator's
    # decode step).
    prefill_tokens = prefill_chunk if prefill_tokens is None else int(prefill_tokens)
    if prefill_tokens < prefill_chunk:
      raise ValueError(f"prefill_tokens={prefill_tokens} must be >= prefill_chunk={prefill_chunk}: "
                       f"the largest bucket holds a whole chunk beside the decode tokens")
    self.buckets = sorted({per_shard + prefill_tokens} | (
        {per_shard, max(per_shard >> 2, 1)} if compact else set()))
    # Attention spans: one, or three prefixes of the rows where the attention implementation
    # reads the whole span it is handed (cuDNN on GPU; attention.attention_spans).
    self.spans = attention.attention_spans(max_len, self.mesh, paged=page_size is not None)
    self.page_size = None if page_size is None else int(page_size)
    if page_size is not None:
      self._check_pages(int(page_size), int(num_pages), data)
    self.max_new_tokens = max_new_tokens
    self.stop_ids = frozenset(int(i) for i in stop_ids) | {int(im_end_id)}
    self.abstract = abstract

    mesh = self.mesh
    self.rows = NamedSharding(mesh, PartitionSpec("data"))  # per-slot arrays [B] and [B, w]
    # The slots whose sampled tokens this process reads: those of its devices' data shards (all
    # on one process). Another process's rows are known here by their counts and last tokens.
    self.readable = frozenset(range(num_slots)) if abstract or self.rows.is_fully_addressable else (
        frozenset(i for index in self.rows.addressable_devices_indices_map((num_slots,)).values()
                  for i in range(num_slots)[index[0]]))
    self.scheduler = Scheduler(
        num_slots=num_slots, shards=data, max_len=max_len, prefill_chunk=prefill_chunk,
        max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, im_end_id=im_end_id,
        buckets=self.buckets, decode_steps=self.decode_steps, prefill_hold=self.prefill_hold,
        max_steps=None if version_steps is None else int(version_steps.max_steps),
        page_size=self.page_size, num_pages=None if num_pages is None else int(num_pages),
        member_slices=member_slices, readable=self.readable)
    replicated = NamedSharding(mesh, PartitionSpec())
    self.param_shardings = partition.param_shardings(model_config, mesh, rules)
    self.abstract_params = sharding.abstract(partition.abstract_params(model_config), self.param_shardings)
    paged = page_size is not None
    self.cache_shardings = partition.cache_shardings(model_config, mesh, rules, paged=paged)
    # On TPU the pages are kept in ragged_paged_attention's interleaved layout (the kernel reads
    # it as is); elsewhere keys and values stay apart, for the portable blockwise path.
    init = (functools.partial(qwen2.PagedKVCache.init, model_config, num_slots, max_len,
                              int(page_size), int(num_pages),
                              interleaved=attention.interleave_pages(mesh)) if paged else
            functools.partial(qwen2.KVCache.init, model_config, num_slots, max_len))
    init_cache = jax.jit(init, out_shardings=self.cache_shardings)
    self.cache = (sharding.abstract(jax.eval_shape(init_cache), self.cache_shardings) if abstract
                  else init_cache())
    self.base_key = (jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                          sharding=replicated)
                     if abstract else jax.random.wrap_key_data(  # host data: placeable on a multi-process mesh
                         jax.device_put(np.asarray(jax.random.key_data(jax.random.key(seed))), replicated)))

    if make_noiser is None:
      self._make_noiser, self.noiser_shardings, self.abstract_noiser = None, None, None
    else:
      slot_ids = jax.ShapeDtypeStruct((num_slots,), jnp.int32, sharding=self.rows)
      # Member slices: versions and members per data shard [D], row_group per slot [B].
      groups = jax.ShapeDtypeStruct((data,), jnp.int32, sharding=self.rows) if member_slices else slot_ids
      self._noiser_args = (groups, groups, slot_ids)
      if member_slices:
        make_noiser = functools.partial(_in_slices, make_noiser)
      shapes = jax.eval_shape(make_noiser, self.abstract_params, *self._noiser_args)
      self.noiser_shardings = (shapes.slice_shardings(self.param_shardings) if member_slices
                               else jax.tree.map(self._noiser_leaf_sharding, shapes))
      self.abstract_noiser = sharding.abstract(shapes, self.noiser_shardings)
      self._make_noiser = jax.jit(make_noiser, in_shardings=(self.param_shardings, self.rows,
                                                             self.rows, self.rows),
                                  out_shardings=self.noiser_shardings)
    rows = self.rows
    cache_spec = self.cache_shardings.k.spec
    layout = (mesh, cache_spec[1], cache_spec[3])  # attention.Rows: batch and KV-head axes
    self._layout = layout
    self._replicated = replicated
    self._call_fn = self._jitted(graphdef, with_steps=False)
    self._reset = jax.jit(_reset_rows, donate_argnames=("cache",),
                          in_shardings=(self.cache_shardings, rows),
                          out_shardings=self.cache_shardings)
    self.version_steps = version_steps
    self.member_slices = member_slices
    self._slice_noisers: dict[int, tuple] = {}  # member_slices: version -> (members [D], noiser)
    if member_slices and (make_noiser is None or version_steps is not None):
      raise ValueError("member_slices needs a noiser (make_noiser) and no version_steps (full-rank "
                       "members' weights are not a low-rank step apart)")
    if version_steps is not None:
      if make_noiser is None:
        raise ValueError("version_steps needs a noiser (make_noiser): the steps are added through it")
      self._init_version_steps(graphdef)
    # version, or a call's versions (a tuple) -> (versions [B], members [B] built for, noiser)
    self._noisers: dict[Any, tuple] = {}
    self._steps: dict[int, Any] = {}     # version v -> the low-rank step from v - 1 to v
    self._stacked: dict[tuple, Any] = {}  # the steps a call adds, stacked
    self._in_place: dict[int, tuple] = {}  # version -> (params as given, params in place)
    self._compiled_before = self._compiled()

  # The scheduler's state, read by callers and tests.
  @property
  def slots(self) -> list[Slot]:
    return self.scheduler.slots

  @property
  def pool(self):
    return self.scheduler.pool

  @property
  def stats(self) -> EngineStats:
    return self.scheduler.stats

  def _check_pages(self, page_size: int, num_pages: int, data: int) -> None:
    if page_size < 1 or num_pages < 1:
      raise ValueError(f"page_size and num_pages must be >= 1, got page_size={page_size}, "
                       f"num_pages={num_pages}")
    if num_pages % data:
      raise ValueError(f"num_pages={num_pages} is not divisible by the mesh's data={data}: every "
                       f"data shard owns the same number of pages")
    bad = [a for a in self.spans if a % page_size]
    if bad:
      raise ValueError(f"page_size={page_size} must divide every attention span {self.spans} "
                       f"(max_len={self.max_len} and its half and quarter); {bad} are not multiples")

  def _init_version_steps(self, graphdef) -> None:
    vs, rows, replicated = self.version_steps, self.rows, self._replicated
    K, N = int(vs.max_steps), int(vs.cohort)
    cohort = (jax.ShapeDtypeStruct((N,), jnp.int32, sharding=replicated),) * 2 + (
        jax.ShapeDtypeStruct((N,), jnp.float32, sharding=replicated),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
    self._cohort_shapes = cohort
    one = jax.eval_shape(vs.make, *cohort)
    # Steps are shared by every row: replicated, as the noiser's leaves without a per-slot axis
    # are (``_noiser_leaf_sharding``); their [B, K] row weights live with the rows.
    self._step_shapes = sharding.abstract(one, jax.tree.map(lambda _: replicated, one))
    self._stacked_shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((K,) + x.shape, x.dtype, sharding=replicated), one)
    self._make_step = jax.jit(vs.make, in_shardings=replicated, out_shardings=replicated)
    self._zero_step = None
    self._stack = jax.jit(_stack_steps, out_shardings=replicated)
    self._merge = jax.jit(_merge_noisers, in_shardings=(self.noiser_shardings,
                                                        (self.noiser_shardings,) * K, rows),
                          out_shardings=self.noiser_shardings)
    self._versions_call_fn = self._jitted(graphdef, with_steps=True)

  def _jitted(self, graphdef, with_steps: bool):
    """``step_program.call`` jitted for this engine: the attention span static, the cache
    donated and updated in place, every argument's sharding named (positional: jit with
    in_shardings takes no kwargs)."""
    rows, replicated = self.rows, self._replicated
    per_token = (rows,) * 5                    # index, tokens, positions, valid, offsets
    per_sample = (rows,)                       # sample_at
    per_slot = (rows,) * 4                     # streams, counters, temperature, top_p
    shardings = (self.param_shardings, self.noiser_shardings, self.cache_shardings, *per_token,
                 *per_sample, replicated, *per_slot, rows) + ((replicated, rows) if with_steps else ())
    fn = _step_function(graphdef, self._layout, self.decode_steps, tuple(sorted(self.stop_ids)),
                        self.page_size is not None)
    # Each row's count of sampled tokens and last token come back replicated (gathered in the
    # program): every process takes the same decisions from them, reading its own rows' tokens.
    return jax.jit(fn, static_argnums=0, donate_argnums=(3,), in_shardings=shardings,
                   out_shardings=((rows, rows, replicated, replicated), self.cache_shardings))

  def abstract_version_steps(self) -> list:
    """A bound on the low-rank steps (abstract, with shardings) this engine holds at once, for
    sizing: the registered steps of the ``max_steps + 1`` versions after the oldest live one,
    the zero step that pads a stack, and the stacks of the calls the oldest base can make
    (``max_steps`` of them, ``max_steps`` steps each). Empty without ``version_steps``."""
    if self.version_steps is None:
      return []
    K = int(self.version_steps.max_steps)
    return [self._step_shapes] * (K + 2) + [self._stacked_shapes] * K

  def _noiser_leaf_sharding(self, leaf) -> NamedSharding:
    """Noiser leaves with one entry per slot live with their rows (over ``data``); anything else
    (a full-rank member's weights) is replicated."""
    per_row = leaf.ndim >= 1 and leaf.shape[0] == self.num_slots
    return NamedSharding(self.mesh, PartitionSpec("data" if per_row else None))

  def programs(self) -> dict[str, Any]:
    """Every program this engine runs, lowered over abstract arguments (nothing allocated):
    ``step[t=N,span=A]`` for each token bucket (N flat tokens in all, ``buckets`` x data
    shards) and span, ``reset``, and ``noiser`` (its build) when there is a noiser; with
    ``version_steps`` also ``step[t=N,span=A,steps=K]`` (rows of several versions),
    ``version_step`` (a step's build), ``stack_steps`` and ``merge_noisers``. ``.compile()``
    each for its memory analysis."""
    return {name: lower() for name, lower in self.lowerings().items()}

  def lowerings(self) -> dict[str, Callable[[], Any]]:
    """``programs()``'s names, each with a function that lowers that program when called: a
    caller that compiles a few of them (``jaxes.preflight --only``) lists every name without
    tracing the rest."""
    B = self.num_slots
    def rows(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=self.rows)
    slot_ids = rows((B,), jnp.int32)
    per_slot = (rows((B,), jnp.uint32), slot_ids, rows((B,), jnp.float32), rows((B,), jnp.float32))
    key = self.base_key if self.abstract else jax.ShapeDtypeStruct(
        self.base_key.shape, self.base_key.dtype, sharding=self.base_key.sharding)
    cache = self.cache if self.abstract else sharding.abstract(self.cache, self.cache_shardings)
    variants = [("", self._call_fn, ())]
    if self.version_steps is not None:
      K = int(self.version_steps.max_steps)
      variants.append((f",steps={K}", self._versions_call_fn,
                       (self._stacked_shapes, rows((B, K), jnp.float32))))
    out = {}
    for suffix, fn, steps in variants:
      for t in self.buckets:
        n, samples = t * self.shards, self.scheduler.samples(t) * self.shards
        flat = (rows((n,), jnp.int32), rows((n,), jnp.int32), rows((n,), jnp.int32),
                rows((n,), jnp.bool_), rows((n,), jnp.int32))
        for span in self.spans:
          out[f"step[t={n},span={span}{suffix}]"] = functools.partial(
              fn.lower, span, self.abstract_params, self.abstract_noiser, cache, *flat,
              rows((samples,), jnp.int32), key, *per_slot, rows((samples,), jnp.int32), *steps)
    out["reset"] = functools.partial(self._reset.lower, cache, rows((B,), jnp.bool_))
    if self._make_noiser is not None:
      out["noiser"] = functools.partial(self._make_noiser.lower, self.abstract_params,
                                        *self._noiser_args)
    if self.version_steps is None:
      return out
    out["version_step"] = functools.partial(self._make_step.lower, *self._cohort_shapes)
    out["stack_steps"] = functools.partial(self._stack.lower, *(self._step_shapes,) * K)
    out["merge_noisers"] = functools.partial(self._merge.lower, self.abstract_noiser,
                                             (self.abstract_noiser,) * K, slot_ids)
    return out

  # -- slot management (host) -------------------------------------------------------------------
  def free_slots(self) -> list[int]:
    """Free slots; with a paged cache, only those of data shards that have a free page."""
    return self.scheduler.free_slots()

  def can_start(self, index: int, prompt_len: int) -> bool:
    """False when ``start`` would have to wait: a paged cache whose slot's shard has too few
    free pages for the prompt right now (it would fit in the shard's pages once some return)."""
    return self.scheduler.can_start(index, prompt_len)

  def kv_bytes(self) -> dict[str, int]:
    """Bytes of cache memory: ``reserved`` (allocated), ``in_use`` (pages held by slots; dense:
    the tokens the slots hold), ``dense_reserved`` (a dense cache of ``max_len`` per slot)."""
    k = self.cache.k
    per_token = qwen2.cache_bytes_per_token(self.cache)
    dense = self.num_slots * self.max_len * per_token
    if self.page_size is None:
      return dict(reserved=dense, in_use=sum(s.length for s in self.slots) * per_token,
                  dense_reserved=dense)
    page = self.page_size * per_token
    return dict(reserved=k.shape[1] * page, in_use=self.pool.in_use() * page, dense_reserved=dense)

  def busy(self) -> bool:
    return self.scheduler.busy()

  def live_versions(self) -> set[int]:
    return self.scheduler.live_versions()

  def slice_members(self) -> list:
    """Each data shard's ``(version, member)``: that of its slots' episodes, None when all its
    slots are free (with ``member_slices`` a shard holds one at a time)."""
    return self.scheduler.slice_members()

  def start(self, index: int, prompt: list[int], *, version: int, member: int, stream: int,
            temperature: float = 0.0, top_p: float = 1.0, tag: Any = None) -> bool:
    """Begin an episode in a free slot; False (slot untouched) if the prompt leaves no room (in
    a cache row, or in all of a paged shard's pages). A paged cache takes the prompt's pages now;
    when too few are free (``can_start`` is False) the caller must wait: an error."""
    return self.scheduler.start(index, prompt, version=version, member=member, stream=stream,
                                temperature=temperature, top_p=top_p, tag=tag)

  def continue_turn(self, index: int, observation: list[int], version: int | None = None) -> bool:
    """Close the parked slot's assistant turn and queue the observation; False if the cache row
    cannot hold it plus one new token, or (paged) its shard has too few free pages for it
    (``Slot.failure`` is then ``PAGES_EXHAUSTED``); the caller then ends the episode.
    ``version``: a newer version whose weights decode the rest of the episode (an in-flight
    version change, PipelineRL's), the row keeping its member's noise (``Slot.noise_version``);
    the cache keeps the keys and values the older weights wrote. Refused under member slices."""
    return self.scheduler.continue_turn(index, observation, version)

  def add_step(self, version: int, versions, members, weights, count) -> bool:
    """Register that ``version`` is ``version - 1`` plus the low-rank step of the update that
    consumed this cohort (host arrays, ``Strategy.cohort``): rows of ``version`` may then run in
    a call based on an older live version. False (nothing registered; such rows keep calls of
    their own) without ``version_steps`` or when the cohort is not ``VersionSteps.cohort`` long."""
    vs = self.version_steps
    if vs is None or self.abstract or len(versions) != int(vs.cohort):
      return False
    cohort = (np.asarray(versions, np.int32), np.asarray(members, np.int32),
              np.asarray(weights, np.float32), np.asarray(count, np.int32))
    self._steps[int(version)] = self._make_step(*self._on_every_device(*cohort))
    return True

  def release(self, index: int) -> None:
    self.scheduler.release(index)   # the noisers stay: a free row is in no call

  # -- device steps -----------------------------------------------------------------------------
  def _placed(self, *arrays: np.ndarray) -> tuple:
    """Per-slot host arrays as arguments of the jitted programs, in the rows' sharding as
    ``programs()`` lowers them (numpy arguments trace to programs of another text, which the
    persistent cache keys apart); on a multi-process mesh global arrays, each process filling its
    own shards from its copy (identical on every process: the host state is).

    Copies are placed: on CPU ``device_put`` may alias a numpy array's memory, and the scheduler
    writes its arrays in place while a dispatched call may not have read them yet."""
    if self.rows.is_fully_addressable:   # placed as programs() lowers them: one cache entry
      return tuple(jax.device_put(tuple(np.array(x) for x in arrays), self.rows))
    return tuple(jax.make_array_from_callback(x.shape, self.rows, lambda index, x=x.copy(): x[index])
                 for x in arrays)

  def _on_every_device(self, *arrays: np.ndarray) -> tuple:
    """Host arrays as replicated arguments (``_placed``'s counterpart for arrays without rows)."""
    if self._replicated.is_fully_addressable:   # copies, as in _placed
      return tuple(jax.device_put(tuple(np.array(x) for x in arrays), self._replicated))
    return tuple(jax.make_array_from_callback(x.shape, self._replicated,
                                              lambda index, x=x.copy(): x[index]) for x in arrays)

  def _place(self, version: int, params):
    """``params`` in the rule table's shardings, moved once per version (a new object is placed
    again): a no-op when they already are there, e.g. loaded by ``hf.load(mesh=...)``."""
    held = self._in_place.get(version)
    if held is None or held[0] is not params:
      self._in_place = {v: p for v, p in self._in_place.items() if v in self.live_versions()}
      self._in_place[version] = held = (params, jax.device_put(params, self.param_shardings))
    return held[1]

  def _assignment(self) -> tuple[np.ndarray, np.ndarray]:
    """Every slot's (noise version, member) as a noiser is built for them (free slots: member
    -1); a row that changed version keeps the noise of the member it was started as."""
    return (np.array([s.noise_version for s in self.slots], np.int32),
            np.array([s.member if s.state != FREE else -1 for s in self.slots], np.int32))

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
    if self._make_noiser is None:
      return None
    if self.member_slices:
      return self._slice_noiser(version, params)
    noiser = self._held_noiser(version, rows, (params,))
    if noiser is None:
      versions, members = self._assignment()
      noiser = self._make_noiser(
          params, *self._placed(versions, members, np.arange(self.num_slots, dtype=np.int32)))
      self._noisers[version] = (versions, members, (params,), noiser)
    return noiser

  def _slice_noiser(self, version: int, params):
    """``version``'s noiser with member slices: group d is the member of data shard d's episodes
    of this version. A shard without any keeps the group it had (its rows are not in this
    version's calls), so the noiser, a model copy per device, is rebuilt only when a shard
    starts another member; the one it replaces is dropped first."""
    want = [m if m is not None and m[0] == version else None for m in self.slice_members()]
    live = self.live_versions()   # the noisers of versions no slot holds go (a copy each)
    self._slice_noisers = {v: x for v, x in self._slice_noisers.items() if v in live}
    held = self._slice_noisers.get(version)
    if held is None or any(w is not None and w[1] != h for w, h in zip(want, held[0])):
      members = np.array([w[1] if w is not None else held[0][d] if held else -1
                          for d, w in enumerate(want)], np.int32)
      self._slice_noisers.pop(version, None)
      held = None
      per_shard = self.num_slots // self.shards
      noiser = self._make_noiser(params, *self._placed(
          np.full(self.shards, version, np.int32), members,
          np.arange(self.num_slots, dtype=np.int32) // per_shard))
      held = self._slice_noisers[version] = (tuple(int(m) for m in members), noiser)
    return held[1]

  def _versions_noiser(self, base: int, versions: tuple, params_by_version: dict,
                       rows: list[Slot]):
    """The noiser of a call over ``rows`` of ``versions`` (base first): every row's
    perturbation, and its vectors from its own version's noiser (``with_vectors_of``). Rebuilt
    when a row of the call was started since, like the per-version ones; those of the newer
    versions are not kept."""
    placed = tuple(self._place(v, params_by_version[v]) for v in versions)
    merged = self._held_noiser(versions, rows, placed)
    if merged is None:
      K = int(self.version_steps.max_steps)
      noiser = self._noiser(base, placed[0], rows)
      assigned = self._assignment()
      others = [noiser] * K
      for v, params in zip(versions[1:], placed[1:]):
        others[v - base - 1] = self._make_noiser(
            params, *self._placed(*assigned, np.arange(self.num_slots, dtype=np.int32)))
      owner = np.array([s.version - base if s.state != FREE and s.version in versions else 0
                        for s in self.slots], np.int32)
      merged = self._merge(noiser, tuple(others), *self._placed(owner))
      self._noisers[versions] = (*assigned, placed, merged)
    return merged

  def _stacked_steps(self, base: int, newest: int):
    """Steps ``base + 1 ... newest`` stacked into the K slots of the programs (zeros after)."""
    key = (base, newest)
    if key not in self._stacked:
      if self._zero_step is None:   # a cohort of zero weights: a step of zeros, same program
        N = int(self.version_steps.cohort)
        self._zero_step = self._make_step(*self._on_every_device(
            np.zeros(N, np.int32), np.zeros(N, np.int32), np.zeros(N, np.float32), np.int32(1)))
      K = int(self.version_steps.max_steps)
      self._stacked[key] = self._stack(*(self._steps[base + k] if base + k <= newest
                                         else self._zero_step for k in range(1, K + 1)))
    return self._stacked[key]

  def _call(self, params_by_version: dict, group: tuple, rows: list[Slot],
            fed: dict[int, int]) -> list[tuple]:
    """One engine call over ``rows`` (of the versions ``group``, the first the base), each
    feeding ``fed[row]`` tokens, as a flat buffer in the smallest bucket that holds every data
    shard's tokens (``step_program.call``); rows of newer versions add their steps. Each row's
    sampled tokens and their log-probs: none for a row still mid-prefill, else up to its
    ``Scheduler.limit`` (the device loop's)."""
    version, sched = group[0], self.scheduler
    per_shard = self.num_slots // self.shards
    bucket = sched.bucket(fed)
    samples = sched.samples(bucket)
    n = bucket * self.shards
    index, tokens, positions, offsets = (np.zeros(n, np.int32) for _ in range(4))
    valid = np.zeros(n, bool)
    sample_at, limit = np.zeros(samples * self.shards, np.int32), np.zeros(samples * self.shards, np.int32)
    used, sampled = np.zeros(self.shards, int), np.zeros(self.shards, int)
    where, limits = [], []
    for s in rows:
      d, k = sched.shard(s.index), fed[s.index]
      chunk = s.pending[:k] if s.state == PREFILL else s.generated[-1:]
      at = slice(d * bucket + used[d], d * bucket + used[d] + k)
      index[at], tokens[at], valid[at] = s.index - d * per_shard, chunk, True
      positions[at], offsets[at] = s.length + np.arange(k), np.arange(k)
      j = d * samples + sampled[d]
      sample_at[j], limit[j] = used[d] + k - 1, sched.limit(s, k)
      used[d], sampled[d] = used[d] + k, sampled[d] + 1
      where.append(j)
      limits.append(int(limit[j]))
    # The furthest position the call writes: its tokens, then each row's loop tokens.
    need = max(s.length + fed[s.index] + max(k - 1, 0) for s, k in zip(rows, limits))
    span = next((a for a in self.spans if a >= need), self.max_len)
    streams, counters = np.zeros(self.num_slots, np.uint32), np.zeros(self.num_slots, np.int32)
    temperature, top_p = np.zeros(self.num_slots, np.float32), np.ones(self.num_slots, np.float32)
    for s in self.slots:
      streams[s.index], counters[s.index] = s.stream, s.sampled
      temperature[s.index], top_p[s.index] = s.temperature, s.top_p
    params = self._place(version, params_by_version[version])
    args = (*self._placed(index, tokens, positions, valid, offsets, sample_at), self.base_key,
            *self._placed(streams, counters, temperature, top_p, limit))
    newest = max(s.version for s in rows)
    if newest > version:   # rows of several versions: the base's weights plus each row's steps
      step_rows = np.zeros((self.num_slots, int(self.version_steps.max_steps)), np.float32)
      for s in rows:
        step_rows[s.index, :s.version - version] = 1.0
      noiser = self._versions_noiser(version, group, params_by_version, rows)
      (out_tokens, out_logprobs, taken, last), self.cache = self._versions_call_fn(
          span, params, noiser, self.cache, *args, self._stacked_steps(version, newest),
          *self._placed(step_rows))
      self.stats.multi_version_calls += 1
    else:
      noiser = self._noiser(version, params, rows)
      (out_tokens, out_logprobs, taken, last), self.cache = self._call_fn(
          span, params, noiser, self.cache, *args)
    self.stats.host_syncs += 1
    waited = time.perf_counter()
    counts, last = np.asarray(taken), np.asarray(last)   # replicated: on every process
    self.stats.device_wait_s += time.perf_counter() - waited
    out_tokens, out_logprobs = _own_rows(out_tokens, -1), _own_rows(out_logprobs, np.nan)
    taken = [int(counts[j]) for j in where]
    out = []
    for s, j, t in zip(rows, where, taken):
      tokens, logprobs = out_tokens[j, :t].copy(), out_logprobs[j, :t]
      if s.index in self.readable:
        self.stats.tokens_read += t
      elif t:   # another process's row: its count and last token are all this one needs
        tokens[-1] = last[j]
      out.append((tokens, logprobs))
    loop = max(taken) - 1 if taken else 0   # decode steps after the first
    self.stats.rows_busy += len(rows)
    self.stats.rows_total += self.num_slots
    self.stats.rows_computed += samples * self.shards
    self.stats.positions_computed += n + max(loop, 0) * samples * self.shards
    self.stats.loop_steps += max(taken)
    return out

  def step(self, params_by_version: dict) -> list[Turn]:
    """Advances every working slot once (``Scheduler.working``: less the held prefills): per
    live version one call (``Scheduler.pack``, ``_call``) in which decoding rows feed their last
    token and prefilling rows their next prompt chunk (ragged rows in one batch, as the cache
    allows); with ``version_steps``, per group of versions a step apart
    (``Scheduler.groups``). Returns the turns that finished."""
    if self.abstract:
      raise RuntimeError("an abstract engine has no arrays to run; lower its programs() instead")
    sched = self.scheduler
    if sched.to_reset.any():
      self.cache = self._reset(self.cache, *self._placed(sched.to_reset))
      sched.to_reset[:] = False
    finished: list[Turn] = []
    if self.page_size is not None:
      self._page_decoding_rows(finished)
    working = sched.working(self._steps)
    self.stats.busy_steps += bool(working)
    live = self.live_versions()   # noisers of versions no slot holds go
    self._noisers = {k: x for k, x in self._noisers.items()
                     if set(k if isinstance(k, tuple) else (k,)) <= live}
    if self._steps and params_by_version:   # steps up to the oldest version passed are done with
      oldest = min(params_by_version)
      self._steps = {v: x for v, x in self._steps.items() if v > oldest}
      self._stacked = {k: x for k, x in self._stacked.items() if k[0] >= oldest}
    for group in sched.groups(sorted({s.version for s in working}), self._steps):
      rows = [s for s in working if s.version in group]
      fed = sched.pack(rows)
      rows = [s for s in rows if s.index in fed]
      prefill = any(s.state == PREFILL for s in rows)
      out = self._call(params_by_version, group, rows, fed)
      self.stats.prefill_calls += prefill
      self.stats.decode_calls += not prefill
      for s, (tokens, logprobs) in zip(rows, out):
        sched.fed(s, fed[s.index], tokens, logprobs, finished)
    return finished

  def _page_decoding_rows(self, finished: list) -> None:
    """A paged cache: the host's pages for this step's rows (``Scheduler.page_decoding_rows``;
    a row without a page ends its turn into ``finished``), then the device's page table is made
    the host's, if it changed."""
    sched = self.scheduler
    sched.page_decoding_rows(finished)
    if sched.table_changed:
      sh = self.cache_shardings.table
      table = (jax.device_put(sched.table.copy(), sh) if sh.is_fully_addressable else   # as in _placed
               jax.make_array_from_callback(sched.table.shape, sh,
                                            lambda index, x=sched.table.copy(): x[index]))
      self.cache = dataclasses.replace(self.cache, table=table)
      sched.table_changed = False

  def compilations(self) -> int:
    """Programs compiled by this engine's jitted functions since it was built (fixed shapes:
    stays small). Engines of the same configuration share their programs: one that another
    engine compiled already is not compiled, nor counted, again."""
    return self._compiled() - self._compiled_before

  def _compiled(self) -> int:
    fns = [self._call_fn, self._reset] + ([self._make_noiser] if self._make_noiser else [])
    if self.version_steps is not None:
      fns += [self._versions_call_fn, self._make_step, self._stack, self._merge]
    return sum(f._cache_size() for f in fns)

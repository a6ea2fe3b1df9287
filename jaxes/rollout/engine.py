"""Slot-based continuous batching over a KV cache: the device step and the cache.

Three objects share the work. The host's side — slots, KV pages, the prefill hold, version
groups, what each row feeds and samples — is ``jaxes.rollout.scheduler`` (plain Python, no JAX):
whoever schedules episodes starts, continues and releases them through ``Engine.scheduler``.
What a call's rows decode with — a version's parameters and, for ES, each row's member noise and
the low-rank steps between versions — is the algorithm's policy bank
(``jaxes.rollout.policy_bank``). The engine holds the cache and the compiled step programs (``jaxes.rollout.step_program``), and
``step`` turns the scheduler's decisions into calls.

``B`` slots share one cache ``[L, B, S, ...]``. A slot holds one episode: its prompt is prefilled
in chunks of at most ``prefill_chunk`` tokens, then tokens are decoded until a stop id or the
turn's budget; the finished turn is handed back and the slot is *parked* (its cache row kept)
while the caller runs the command in a sandbox, then ``Scheduler.continue_turn`` queues the
observation. Each step makes one call per group of live versions (``Scheduler.groups``): one
flat buffer of tokens, decoding rows feeding their last token and prefilling rows their next
chunk, padded per data shard to the smallest token bucket that holds them (``Engine.buckets``: a
quarter of the shard's rows, all of them, all plus a chunk; one program each, whatever the mix),
so parked, free and other-version rows cost nothing (compaction, ``compact=True``). Rows whose
prompt is done decode on in an on-device loop, up to ``decode_steps`` tokens per call
(``jaxes.rollout.decode_loop``), the host reading the sampled tokens once per call. Attention
reads key blocks up to the call's furthest token only (one span, the whole row; on GPU, where
cuDNN takes the whole span, the shortest of three prefixes that holds every row of the call,
``Engine.spans``). The step compiles ``len(buckets) * len(spans)`` programs for the life of the
engine (3 for the paper config off GPU), twice that with version steps.

A paged KV cache (``page_size=P, num_pages=N``; default: dense rows of ``max_len``) keeps keys
and values in N pages of P tokens split over the ``data`` shards with the slots; the scheduler
keeps the free pages and the page table, which the engine ships to the devices when it changed.
Every sampled token comes with its log-prob under the distribution it was drawn from
(``Turn.logprobs``). See docs/engine.md for the prefill hold, the paged cache and the costs.

On a mesh (``mesh=``; default: one device) every device array is created where it lives (the
cache by a jitted init with the logical-axis rules' shardings: slots over ``data``, KV heads over
``tensor`` where they divide), and the step is jitted with explicit in/out shardings — one tree
each for the policy, the cache, the step's inputs and the version steps — the cache donated and
updated in place. With ``abstract=True`` nothing is allocated and ``programs()`` lowers every
program the engine runs, for ``jaxes.preflight`` to compile (``lowerings()``: the same names,
lowered on demand).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxes import sharding
from jaxes.errors import OptionError
from jaxes.models import attention, partition, qwen2
from jaxes.rollout import step_program
from jaxes.rollout.placement import Placement
from jaxes.rollout.policy_bank import PolicyBank
# The host side's types and states, part of the engine's API (``step``'s turns, ``stats``).
from jaxes.rollout.scheduler import (DECODE, FREE, PAGES_EXHAUSTED, PARKED, PREFILL,  # noqa: F401
                                     EngineStats, Scheduler, Slot, Turn)
from jaxes.rollout.step_program import Samples, SlotSampling, StepInputs, Tokens


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


def _buckets(per_shard: int, prefill_chunk: int, prefill_tokens: int | None, compact: bool) -> list:
  """Token buckets: the flat tokens per data shard an engine call holds, padded up to the
  smallest that fits (one compiled program each). The largest holds every row's decode token plus
  a full prefill chunk (a call's prefill is cut to fit, the rest goes next call); the full rows
  and a quarter of them serve decode-only calls (compaction's effect: below a quarter the
  weights, read once per call whatever its tokens, are most of an accelerator's decode step)."""
  prefill_tokens = prefill_chunk if prefill_tokens is None else int(prefill_tokens)
  return sorted({per_shard + prefill_tokens} | (
      {per_shard, max(per_shard >> 2, 1)} if compact else set()))


def check_settings(*, max_len: int, max_new_tokens: int, prefill_chunk: int,
                   prefill_tokens: int | None, page_size: int | None, num_pages: int | None,
                   prefill_hold: int, decode_steps: int) -> None:
  """The engine's rules on its settings, the one place they live: ``Engine`` checks its arguments
  with them and config validation its ``rollout`` block (``OptionError`` names the option)."""
  if max_len <= max_new_tokens:
    raise OptionError("max_len", f"must exceed max_new_tokens={max_new_tokens}, got {max_len}",
                      f"max_len={max_len} must exceed max_new_tokens={max_new_tokens}")
  if (page_size is None) != (num_pages is None):
    raise OptionError("num_pages", f"and page_size go together (both unset: the dense cache), got "
                      f"page_size={page_size}, num_pages={num_pages}",
                      f"page_size and num_pages go together, got page_size={page_size}, "
                      f"num_pages={num_pages}")
  if prefill_hold < 0:
    raise OptionError("prefill_hold", f"must be >= 0, got {prefill_hold}")
  if decode_steps < 1:
    raise OptionError("decode_steps", f"must be >= 1, got {decode_steps}")
  if prefill_tokens is not None and prefill_tokens < prefill_chunk:
    raise OptionError("prefill_tokens", f"must be 0 (prefill_chunk) or >= prefill_chunk={prefill_chunk} "
                      f"(the largest token bucket holds a whole chunk beside the decode tokens), "
                      f"got {prefill_tokens}",
                      f"prefill_tokens={prefill_tokens} must be >= prefill_chunk={prefill_chunk}: "
                      f"the largest bucket holds a whole chunk beside the decode tokens")


class Engine:
  """``policy``: the bank that says what each call decodes with (``policy_bank.PolicyBank``, the
  default: every row its version's parameters; ``ESPolicyBank``: each row its member's noise);
  the engine binds it. ``mesh``: a (data, fsdp, tensor) mesh (``jaxes.sharding.make_mesh``) whose
  ``data`` size divides ``num_slots``; None = the first device. ``abstract``: allocate nothing
  (see ``programs``). ``compact``: run a call on its working rows only when they fit a smaller
  compiled batch; False: every call runs all B rows. ``page_size``/``num_pages``: a paged KV
  cache split over the ``data`` shards with the slots; None: one dense ``max_len`` row per slot.
  ``prefill_hold``: steps a new prefill may wait while other rows decode; 0: none waits.
  ``prefill_tokens``: prefill tokens per data shard a call may hold beside its decode tokens
  (the largest bucket; default ``prefill_chunk``), a row still taking at most a chunk."""

  def __init__(self, graphdef, model_config: qwen2.Qwen2Config, *, num_slots: int, max_len: int,
               prefill_chunk: int, max_new_tokens: int, stop_ids, im_end_id: int,
               policy: PolicyBank | None = None, seed: int = 0, mesh: Mesh | None = None,
               rules=sharding.LOGICAL_RULES, abstract: bool = False, compact: bool = True,
               page_size: int | None = None, num_pages: int | None = None, prefill_hold: int = 8,
               decode_steps: int = 8, prefill_tokens: int | None = None):
    check_settings(max_len=max_len, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                   prefill_tokens=prefill_tokens, page_size=page_size, num_pages=num_pages,
                   prefill_hold=prefill_hold, decode_steps=decode_steps)
    self.mesh = mesh = sharding.make_mesh(devices=jax.devices()[:1]) if mesh is None else mesh
    data = mesh.shape["data"]
    if num_slots % data:
      raise ValueError(f"num_slots={num_slots} is not divisible by the mesh's data={data}: "
                       f"every data shard must hold the same number of slots")
    self.num_slots, self.max_len, self.chunk, self.max_new_tokens = (
        num_slots, max_len, prefill_chunk, max_new_tokens)
    self.prefill_hold, self.decode_steps = int(prefill_hold), int(decode_steps)
    self.shards, self.compact, self.abstract = data, compact, abstract
    self.buckets = _buckets(num_slots // data, prefill_chunk, prefill_tokens, compact)
    # Attention spans: one, or three prefixes of the rows where the attention implementation
    # reads the whole span it is handed (cuDNN on GPU; attention.attention_spans).
    self.spans = attention.attention_spans(max_len, self.mesh, paged=page_size is not None)
    self.page_size = None if page_size is None else int(page_size)
    if page_size is not None:
      self._check_pages(int(page_size), int(num_pages), data)
    self.stop_ids = frozenset(int(i) for i in stop_ids) | {int(im_end_id)}

    self.param_shardings = partition.param_shardings(model_config, mesh, rules)
    self.abstract_params = sharding.abstract(partition.abstract_params(model_config),
                                             self.param_shardings)
    self.placement = Placement(mesh, num_slots, self.param_shardings, abstract)
    self.rows = self.placement.rows
    self.readable = self.placement.readable()
    self.policy = PolicyBank() if policy is None else policy
    self.scheduler = Scheduler(
        num_slots=num_slots, shards=data, max_len=max_len, prefill_chunk=prefill_chunk,
        max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, im_end_id=im_end_id,
        buckets=self.buckets, decode_steps=self.decode_steps, prefill_hold=self.prefill_hold,
        max_steps=self.policy.max_steps, page_size=self.page_size,
        num_pages=None if num_pages is None else int(num_pages),
        member_slices=self.policy.member_slices, readable=self.readable)
    self.stats: EngineStats = self.scheduler.stats   # the scheduler's and the calls' counters
    self.policy.bind(self.placement, self.abstract_params, self.scheduler)

    self.cache_shardings = partition.cache_shardings(model_config, mesh, rules,
                                                     paged=page_size is not None)
    # On TPU the pages are kept in ragged_paged_attention's interleaved layout (the kernel reads
    # it as is); elsewhere keys and values stay apart, for the portable blockwise path.
    init = (functools.partial(qwen2.PagedKVCache.init, model_config, num_slots, max_len,
                              int(page_size), int(num_pages),
                              interleaved=attention.interleave_pages(mesh))
            if page_size is not None else
            functools.partial(qwen2.KVCache.init, model_config, num_slots, max_len))
    init_cache = jax.jit(init, out_shardings=self.cache_shardings)
    self.cache = (sharding.abstract(jax.eval_shape(init_cache), self.cache_shardings) if abstract
                  else init_cache())
    replicated = self.placement.replicated
    self.base_key = (jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                          sharding=replicated)
                     if abstract else jax.random.wrap_key_data(  # host data: placeable on a multi-process mesh
                         jax.device_put(np.asarray(jax.random.key_data(jax.random.key(seed))), replicated)))
    cache_spec = self.cache_shardings.k.spec
    self._layout = (mesh, cache_spec[1], cache_spec[3])  # attention.Rows: batch and KV-head axes
    self._call_fns = {False: self._jitted(graphdef, with_steps=False)}
    if self.policy.max_steps is not None:
      self._call_fns[True] = self._jitted(graphdef, with_steps=True)
    self._reset = jax.jit(_reset_rows, donate_argnames=("cache",),
                          in_shardings=(self.cache_shardings, self.rows),
                          out_shardings=self.cache_shardings)
    self._compiled_before = self._compiled()

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

  def _jitted(self, graphdef, with_steps: bool):
    """``step_program.call`` jitted for this engine: the attention span static, the cache
    donated and updated in place, the policy's, the cache's, the inputs' and (``with_steps``) the
    version steps' shardings one tree each. Each row's count of sampled tokens and last token come back replicated (gathered in the
    program): every process takes the same decisions from them, reading its own rows' tokens."""
    rows, replicated = self.rows, self.placement.replicated
    fn = _step_function(graphdef, self._layout, self.decode_steps, tuple(sorted(self.stop_ids)),
                        self.page_size is not None)
    return jax.jit(fn, static_argnums=0, donate_argnums=(2,), in_shardings=(
        self.policy.shardings(), self.cache_shardings,
        step_program.input_shardings(rows, replicated),
        *((self.policy.step_shardings(),) if with_steps else ())),
                   out_shardings=((rows, rows, replicated, replicated), self.cache_shardings))

  def programs(self) -> dict[str, Any]:
    """Every program this engine runs, lowered over abstract arguments (nothing allocated):
    ``step[t=N,span=A]`` for each token bucket (N flat tokens in all, ``buckets`` x data
    shards) and span, ``reset``, and the policy bank's (``noiser``, its build; with version
    steps also ``step[t=N,span=A,steps=K]``, ``version_step``, ``stack_steps`` and
    ``merge_noisers``). ``.compile()`` each for its memory analysis."""
    return {name: lower() for name, lower in self.lowerings().items()}

  def lowerings(self) -> dict[str, Callable[[], Any]]:
    """``programs()``'s names, each with a function that lowers that program when called: a
    caller that compiles a few of them (``jaxes.preflight --only``) lists every name without
    tracing the rest."""
    B = self.num_slots
    def rows(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=self.rows)
    slots = SlotSampling(rows((B,), jnp.uint32), rows((B,), jnp.int32), rows((B,), jnp.float32),
                         rows((B,), jnp.float32))
    key = self.base_key if self.abstract else jax.ShapeDtypeStruct(
        self.base_key.shape, self.base_key.dtype, sharding=self.base_key.sharding)
    cache = self.cache if self.abstract else sharding.abstract(self.cache, self.cache_shardings)
    out = {}
    for with_steps, fn in self._call_fns.items():
      suffix = f",steps={self.policy.max_steps}" if with_steps else ""
      for t in self.buckets:
        n, samples = t * self.shards, self.scheduler.samples(t) * self.shards
        flat = (jnp.int32, jnp.int32, jnp.int32, jnp.bool_, jnp.int32)
        inputs = StepInputs(Tokens(*(rows((n,), dtype) for dtype in flat)),
                            Samples(rows((samples,), jnp.int32), rows((samples,), jnp.int32)),
                            slots, key)
        for span in self.spans:
          out[f"step[t={n},span={span}{suffix}]"] = functools.partial(
              fn.lower, span, self.policy.abstract(), cache, inputs,
              *((self.policy.abstract_steps(),) if with_steps else ()))
    out["reset"] = functools.partial(self._reset.lower, cache, rows((B,), jnp.bool_))
    return {**out, **self.policy.lowerings()}

  def kv_bytes(self) -> dict[str, int]:
    """Bytes of cache memory: ``reserved`` (allocated), ``in_use`` (pages held by slots; dense:
    the tokens the slots hold), ``dense_reserved`` (a dense cache of ``max_len`` per slot)."""
    per_token = qwen2.cache_bytes_per_token(self.cache)
    dense = self.num_slots * self.max_len * per_token
    if self.page_size is None:
      return dict(reserved=dense, in_use=sum(s.length for s in self.scheduler.slots) * per_token,
                  dense_reserved=dense)
    page = self.page_size * per_token
    return dict(reserved=self.cache.k.shape[1] * page, in_use=self.scheduler.pool.in_use() * page,
                dense_reserved=dense)

  # -- device steps -----------------------------------------------------------------------------
  def _call(self, params_by_version: dict, group: tuple, rows: list[Slot],
            fed: dict[int, int]) -> list[tuple]:
    """One engine call over ``rows`` (of the versions ``group``, the first the base), each
    feeding ``fed[row]`` tokens, as a flat buffer in the smallest bucket that holds every data
    shard's tokens (``step_program.call``). Each row's sampled tokens and their log-probs: none
    for a row still mid-prefill, else up to its ``Scheduler.limit`` (the device loop's)."""
    bucket = self.scheduler.bucket(fed)
    per_token, per_sample, per_slot, where = self.scheduler.call_arrays(rows, fed, bucket)
    by_rows = self.placement.by_rows
    inputs = StepInputs(Tokens(*by_rows(*per_token)), Samples(*by_rows(*per_sample)),
                        SlotSampling(*by_rows(*per_slot)), self.base_key)
    limits = [int(per_sample[1][j]) for j in where]
    # The furthest position the call writes: its tokens, then each row's loop tokens.
    need = max(s.length + fed[s.index] + max(k - 1, 0) for s, k in zip(rows, limits))
    span = next((a for a in self.spans if a >= need), self.max_len)
    decoding, steps = self.policy.decoding(group, rows, params_by_version)
    extra = () if steps is None else (steps,)   # rows of newer versions: their low-rank steps
    (out_tokens, out_logprobs, taken, last), self.cache = self._call_fns[bool(extra)](
        span, decoding, self.cache, inputs, *extra)
    self.stats.multi_version_calls += bool(extra)
    self.stats.host_syncs += 1
    waited = time.perf_counter()
    counts, last = np.asarray(taken), np.asarray(last)   # replicated: on every process
    self.stats.device_wait_s += time.perf_counter() - waited
    own = self.placement.own_rows
    out_tokens, out_logprobs = own(out_tokens, -1), own(out_logprobs, np.nan)
    taken = [int(counts[j]) for j in where]
    out = []
    for s, j, t in zip(rows, where, taken):
      tokens, logprobs = out_tokens[j, :t].copy(), out_logprobs[j, :t]
      if s.index in self.readable:
        self.stats.tokens_read += t
      elif t:   # another process's row: its count and last token are all this one needs
        tokens[-1] = last[j]
      out.append((tokens, logprobs))
    computed = self.scheduler.samples(bucket) * self.shards   # the rows the LM head ran
    self.stats.rows_busy += len(rows)
    self.stats.rows_total += self.num_slots
    self.stats.rows_computed += computed
    self.stats.positions_computed += bucket * self.shards + max(max(taken) - 1, 0) * computed
    self.stats.loop_steps += max(taken)
    return out

  def step(self, params_by_version: dict) -> list[Turn]:
    """Advances every working slot once (``Scheduler.working``: less the held prefills): per
    group of versions (``Scheduler.groups``) one call (``Scheduler.pack``, ``_call``) in which
    decoding rows feed their last token and prefilling rows their next prompt chunk.
    ``params_by_version`` must hold every slot's version. Returns the turns that finished."""
    if self.abstract:
      raise RuntimeError("an abstract engine has no arrays to run; lower its programs() instead")
    sched = self.scheduler
    if sched.to_reset.any():
      self.cache = self._reset(self.cache, *self.placement.by_rows(sched.to_reset))
      sched.to_reset[:] = False
    finished: list[Turn] = []
    if self.page_size is not None:
      self._page_decoding_rows(finished)
    working = sched.working(self.policy.stepped)
    self.stats.busy_steps += bool(working)
    self.policy.retire(params_by_version)
    for group in sched.groups(sorted({s.version for s in working}), self.policy.stepped):
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
      table = self.placement.put(sched.table, self.cache_shardings.table)
      self.cache = dataclasses.replace(self.cache, table=table)
      sched.table_changed = False

  def compilations(self) -> int:
    """Programs compiled by this engine's jitted functions since it was built (fixed shapes:
    stays small). Engines of the same configuration share their programs: one that another
    engine compiled already is not compiled, nor counted, again."""
    return self._compiled() - self._compiled_before

  def _compiled(self) -> int:
    fns = [*self._call_fns.values(), self._reset, *self.policy.jitted()]
    return sum(f._cache_size() for f in fns)

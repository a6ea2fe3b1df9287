"""The engine's host side, in plain Python: slots, KV pages, the prefill hold, version groups.

``Scheduler`` keeps every slot's state (free, prefilling, decoding, parked: the caller runs the
command in a sandbox), the free-page pool and page table of a paged cache, and takes the
decisions of an engine step that depend on the slots alone: which new prefills wait
(``held``), which versions share a call (``groups``), how many tokens each row feeds in a call
(``pack``) and may sample (``limit``), which rows take pages or end for lack of one
(``page_decoding_rows``), and what a call's sampled tokens do to each row (``fed``). The
``Engine`` (``jaxes.rollout.engine``) turns those decisions into device calls; whoever schedules
episodes (``jaxes.rollout.episodes``, the benchmarks, the tests) calls ``start``,
``continue_turn`` and ``release`` here directly. Nothing here
reads the clock or a device, so every process of a multi-process run takes the same decisions
from the same inputs: a row's sampled ids matter only through its count and last token, which
every process has (``Engine.readable`` says whose ids a process reads).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection

import numpy as np

from jaxes.rollout import pages as page_pool

FREE, PREFILL, DECODE, PARKED = "free", "prefill", "decode", "parked"
# Why a paged engine ended a turn or refused an observation: no free page in the slot's shard.
PAGES_EXHAUSTED = "kv_pages_exhausted"


@dataclasses.dataclass
class Slot:
  index: int
  state: str = FREE
  version: int = 0
  member: int = -1               # -1: unperturbed policy
  stream: int = 0                # sampling stream (one per job), see sampling.row_keys
  temperature: float = 0.0
  top_p: float = 1.0
  length: int = 0                # tokens in this slot's cache row
  pending: list = dataclasses.field(default_factory=list)    # tokens waiting for prefill
  generated: list = dataclasses.field(default_factory=list)  # this turn's sampled tokens
  logprobs: list = dataclasses.field(default_factory=list)   # ... and each one's log-prob
  max_new: int = 0
  sampled: int = 0               # tokens sampled in this episode (the sampling counter)
  tag: Any = None                # the caller's handle for this episode
  pages: list = dataclasses.field(default_factory=list)      # paged cache: its pages, in order
  failure: str | None = None     # why the engine ended or refused this episode (PAGES_EXHAUSTED)
  held: int | None = None        # steps its prefill (a prompt or observation not yet fed) has
                                 # been held back (``prefill_hold``); None once a chunk is fed
  noise_version: int = 0         # the version whose member noise the row carries: ``version``
                                 # unless a turn moved it to newer weights (``continue_turn``)


@dataclasses.dataclass(frozen=True)
class Turn:
  slot: int
  tokens: list | None            # sampled ids, stop id included when one ended the turn; None:
                                 # another process's row (``Engine.readable``), read there only
  logprobs: list | None          # each sampled id's log-prob under the distribution it was drawn
                                 # from (``sampling.token_logprobs``; 0 when greedy)
  stopped: bool                  # True: a stop id ended it; False: the token budget did
  tag: Any
  failure: str | None = None     # PAGES_EXHAUSTED: cut short for lack of a KV page (the episode
                                 # cannot go on; the caller ends it as truncated)


@dataclasses.dataclass
class EngineStats:
  prefill_calls: int = 0
  decode_calls: int = 0
  rows_busy: int = 0             # sum over calls of rows doing work
  rows_total: int = 0            # sum over calls of B
  tokens_prefilled: int = 0
  tokens_decoded: int = 0
  busy_steps: int = 0            # Engine.step calls that ran at least one engine call
  rows_computed: int = 0         # sum over calls of the compiled batch (compaction: <= B)
  positions_computed: int = 0    # sum over calls of batch x width: the token positions run
  multi_version_calls: int = 0   # calls whose rows belong to more than one version (steps)
  prefill_held: int = 0          # row-steps a new prefill was held back to share a call
  host_syncs: int = 0            # calls whose sampled tokens the host waited for (one each)
  tokens_read: int = 0           # sampled tokens whose ids this process read: its own rows'
                                 # (multi-process: only they are read, nothing is exchanged)
  loop_steps: int = 0            # decode steps run by width-1 calls' device loops
  device_wait_s: float = 0.0     # seconds the host waited for calls' sampled tokens: a step's
                                 # wall time less this is the host's share (``jaxes.measure``)

  @property
  def utilisation(self) -> float:
    return self.rows_busy / self.rows_total if self.rows_total else 0.0

  @property
  def useful_fraction(self) -> float:
    """Tokens fed (prefilled or decoded) per position computed."""
    done = self.tokens_prefilled + self.tokens_decoded
    return done / self.positions_computed if self.positions_computed else 0.0


class Scheduler:
  """The slots of an engine of ``num_slots`` rows split over ``shards`` data shards. ``buckets``:
  the token buckets per shard (``Engine.buckets``, smallest first). ``max_steps``: the most
  low-rank steps a call adds on top of its base version (``policy_bank.VersionSteps.max_steps``;
  None: every version has calls of its own). ``page_size``/``num_pages``: a paged cache (None:
  dense rows of ``max_len``). ``readable``: the slots whose sampled ids this process reads (None:
  all)."""

  def __init__(self, *, num_slots: int, shards: int, max_len: int, prefill_chunk: int,
               max_new_tokens: int, stop_ids: Collection[int], im_end_id: int, buckets: list[int],
               decode_steps: int, prefill_hold: int, max_steps: int | None = None,
               page_size: int | None = None, num_pages: int | None = None,
               member_slices: bool = False, readable: Collection[int] | None = None):
    self.num_slots, self.shards, self.max_len, self.chunk = num_slots, shards, max_len, prefill_chunk
    self.max_new_tokens, self.decode_steps, self.prefill_hold = max_new_tokens, decode_steps, prefill_hold
    self.stop_ids = frozenset(int(i) for i in stop_ids) | {int(im_end_id)}
    self.im_end_id = int(im_end_id)
    self.buckets, self.max_steps, self.member_slices = list(buckets), max_steps, member_slices
    self.readable = frozenset(range(num_slots) if readable is None else readable)
    self.page_size = page_size
    if page_size is not None:
      self.pool = page_pool.PagePool(shards, num_pages // shards)
      self.table = np.zeros((num_slots, max_len // page_size), np.int32)
    self.table_changed = False   # the host table differs from the device's
    self.to_reset = np.zeros(num_slots, bool)   # rows whose cache the next step clears
    self.slots = [Slot(i) for i in range(num_slots)]
    self.stats = EngineStats()

  def shard(self, index: int) -> int:
    return index // (self.num_slots // self.shards)

  def samples(self, bucket: int) -> int:
    """Samples per data shard of a call in ``bucket``: one per row it can hold."""
    return min(bucket, self.num_slots // self.shards)

  def bucket(self, fed: dict[int, int]) -> int:
    """The smallest bucket that holds every data shard's tokens of a call feeding ``fed[row]``."""
    counts = np.bincount([self.shard(i) for i in fed], weights=list(fed.values()),
                         minlength=self.shards)
    return next(t for t in self.buckets if t >= counts.max())

  # -- slots ------------------------------------------------------------------------------------
  def free_slots(self) -> list[int]:
    """Free slots; with a paged cache, only those of data shards that have a free page."""
    free = [s.index for s in self.slots if s.state == FREE]
    if self.page_size is None:
      return free
    return [i for i in free if self.pool.free(self.shard(i))]

  def busy(self) -> bool:
    return any(s.state in (PREFILL, DECODE) for s in self.slots)

  def live_versions(self) -> set[int]:
    return {s.version for s in self.slots if s.state != FREE}

  def slice_members(self) -> list:
    """Each data shard's ``(version, member)``: that of its slots' episodes, None when all its
    slots are free (with ``member_slices`` a shard holds one at a time)."""
    held = [None] * self.shards
    for s in self.slots:
      if s.state != FREE:
        held[self.shard(s.index)] = (s.version, s.member)
    return held

  def can_start(self, index: int, prompt_len: int) -> bool:
    """False when ``start`` would have to wait: a paged cache whose slot's shard has too few
    free pages for the prompt right now (it would fit in the shard's pages once some return)."""
    if self.page_size is None:
      return True
    need = page_pool.pages_for(prompt_len, self.page_size)
    return need > self.pool.pages_per_shard or need <= self.pool.free(self.shard(index))

  def start(self, index: int, prompt: list[int], *, version: int, member: int, stream: int,
            temperature: float = 0.0, top_p: float = 1.0, tag: Any = None) -> bool:
    """Begin an episode in a free slot; False (slot untouched) if the prompt leaves no room (in
    a cache row, or in all of a paged shard's pages). A paged cache takes the prompt's pages now;
    when too few are free (``can_start`` is False) the caller must wait: an error."""
    slot = self.slots[index]
    if slot.state != FREE:
      raise ValueError(f"slot {index} is {slot.state}, not free")
    if len(prompt) + 1 > self.max_len:
      return False
    if self.page_size is not None and (
        page_pool.pages_for(len(prompt), self.page_size) > self.pool.pages_per_shard):
      return False
    if not self.can_start(index, len(prompt)):
      raise ValueError(f"slot {index}: its shard has {self.pool.free(self.shard(index))} free "
                       f"pages, fewer than the prompt's {len(prompt)} tokens need (check can_start)")
    if self.member_slices:
      held = self.slice_members()[self.shard(index)]
      if held not in (None, (version, member)):
        raise ValueError(f"slot {index}: its data shard runs (version, member) {held}, not "
                         f"{(version, member)} (member_slices: one member per shard at a time)")
    self.slots[index] = Slot(index, PREFILL, version, member, stream, temperature, top_p,
                             pending=list(prompt), tag=tag, held=0, noise_version=version)
    self.take_pages(self.slots[index], len(prompt))
    self.to_reset[index] = True
    return True

  def continue_turn(self, index: int, observation: list[int], version: int | None = None) -> bool:
    """Close the parked slot's assistant turn and queue the observation; False if the cache row
    cannot hold it plus one new token, or (paged) its shard has too few free pages for it
    (``Slot.failure`` is then ``PAGES_EXHAUSTED``); the caller then ends the episode.
    ``version``: a newer version whose weights decode the rest of the episode (an in-flight
    version change, PipelineRL's), the row keeping its member's noise (``Slot.noise_version``);
    the cache keeps the keys and values the older weights wrote. Refused under member slices.
    The closing tokens depend on the turn's last token only, which every process knows."""
    slot = self.slots[index]
    if slot.state != PARKED:
      raise ValueError(f"slot {index} is {slot.state}, not parked")
    if version is not None and version != slot.version:
      if version < slot.version:
        raise ValueError(f"slot {index}: continue_turn(version={version}) goes back from "
                         f"version {slot.version}; a turn may only move to newer weights")
      if self.member_slices:
        raise ValueError(f"slot {index}: a version change within an episode needs per-row "
                         f"members; under member_slices a data shard runs one (version, member)")
    if slot.failure is not None:   # cut short for lack of pages: it cannot go on
      return False
    last = slot.generated[-1]
    closing = [last] if last == self.im_end_id else [last, self.im_end_id]
    tokens = closing + list(observation)
    if slot.length + len(tokens) + 1 > self.max_len:
      return False
    if not self.take_pages(slot, slot.length + len(tokens)):
      slot.failure = PAGES_EXHAUSTED
      return False
    slot.pending, slot.generated, slot.logprobs, slot.state = tokens, [], [], PREFILL
    slot.held = 0
    if version is not None:   # the next turn decodes under ``version``, the same member noise
      slot.version = version
    return True

  def release(self, index: int) -> None:
    """End the slot's episode: its pages go back (its policy bank's noisers stay: a free row is
    in no call)."""
    if self.slots[index].state != FREE:
      if self.slots[index].pages:
        self.pool.give(self.shard(index), self.slots[index].pages)
      self.slots[index] = Slot(index)

  # -- pages ------------------------------------------------------------------------------------
  def pages_short(self, slot: Slot, tokens: int) -> int | None:
    """Pages ``slot`` must take to hold ``tokens`` tokens in all: 0 (dense, or enough held), a
    positive count, or None when its shard has fewer free."""
    if self.page_size is None:
      return 0
    need = page_pool.pages_for(tokens, self.page_size) - len(slot.pages)
    return max(need, 0) if need <= self.pool.free(self.shard(slot.index)) else None

  def take_pages(self, slot: Slot, tokens: int) -> bool:
    """Take the pages ``slot`` lacks to hold ``tokens`` tokens (into the host table); False
    (nothing taken) when its shard has too few free."""
    n = self.pages_short(slot, tokens)
    if n is None:
      return False
    if n:
      first = len(slot.pages)
      slot.pages += self.pool.take(self.shard(slot.index), n)
      self.table[slot.index, first:len(slot.pages)] = slot.pages[first:]
      self.table_changed = True
    return True

  def page_decoding_rows(self, finished: list) -> None:
    """A paged cache: every decoding row whose next token starts a page takes one; a row whose
    shard has none free ends its turn here, cut short (``Turn.failure``), and the slot is parked
    for the caller to end. Then the pages of the tokens a device loop may decode this step, where
    free (after every row's next token has its page): without them a row's loop stops at its
    page's end. So does a prefill that may end in this step's call (its chunk is all that is
    left)."""
    for s in self.slots:
      if s.state == DECODE and not self.take_pages(s, s.length + 1):
        s.state, s.failure = PARKED, PAGES_EXHAUSTED
        finished.append(self.turn(s, False, PAGES_EXHAUSTED))
    for s in self.slots:
      if self.decode_steps == 1:
        break
      if s.state == DECODE:
        self.take_pages(s, s.length + min(self.decode_steps, s.max_new - len(s.generated)))
      elif s.state == PREFILL and len(s.pending) <= self.chunk:
        end = s.length + len(s.pending)
        k = min(self.decode_steps, self.max_new_tokens, self.max_len - end)
        self.take_pages(s, end + k - 1)

  # -- a step's decisions -----------------------------------------------------------------------
  def groups(self, versions: list[int], stepped: Collection[int] = ()) -> list[tuple[int, ...]]:
    """Live versions (sorted) as the groups whose rows share calls: a version joins the group of
    the oldest one before it when every step between them is registered (``stepped``: the
    versions whose step from their predecessor the engine holds) and there are at most
    ``max_steps`` of them."""
    groups: list[tuple[int, ...]] = []
    for v in versions:
      if groups and self.max_steps is not None:
        base = groups[-1][0]
        if v - base <= self.max_steps and all(u in stepped for u in range(base + 1, v + 1)):
          groups[-1] += (v,)
          continue
      groups.append((v,))
    return groups

  def held(self, working: list[Slot], stepped: Collection[int] = ()) -> list[Slot]:
    """The new prefills (not yet fed a chunk) that wait this step: while other rows decode, a
    prompt or observation that would need a call of its own (none of its group's rows is
    mid-prefill) waits up to ``prefill_hold`` steps for others to share that call with; all of
    a group's go once the first has waited that long or they are as many as the rows of the
    smallest bucket in some data shard. A function of the slots' states only (no clock)."""
    if not self.prefill_hold or not any(s.state == DECODE for s in working):
      return []   # nothing else to run: a held row would idle the whole step
    held = []
    for group in self.groups(sorted({s.version for s in working}), stepped):
      rows = [s for s in working if s.version in group and s.state == PREFILL]
      new = [s for s in rows if s.held is not None]
      if not new or len(new) < len(rows):   # a row mid-prefill: the call runs anyway
        continue
      fill = np.bincount([self.shard(s.index) for s in new], minlength=self.shards).max()
      if max(s.held for s in new) < self.prefill_hold and fill < self.samples(self.buckets[0]):
        held += new
    return held

  def working(self, stepped: Collection[int] = ()) -> list[Slot]:
    """The rows this step's calls run: those prefilling or decoding, less the held prefills
    (each of which has waited one more step)."""
    working = [s for s in self.slots if s.state in (PREFILL, DECODE)]
    held = {s.index for s in self.held(working, stepped)}
    for s in working:
      if s.index in held:
        s.held += 1
    self.stats.prefill_held += len(held)
    return [s for s in working if s.index not in held]

  def pack(self, rows: list[Slot]) -> dict[int, int]:
    """Tokens each row feeds in one call: a decoding row its last token, a prefilling row its
    next chunk (at most ``prefill_chunk``), cut so that no data shard's tokens exceed the
    largest bucket (decoding rows first, then prefills in slot order; a prefill cut to nothing
    waits for the next call). Every shard has room for a whole chunk beside its decode tokens."""
    room = np.full(self.shards, self.buckets[-1])
    fed = {}
    for s in sorted(rows, key=lambda s: (s.state != DECODE, s.index)):
      d = self.shard(s.index)
      n = 1 if s.state == DECODE else min(len(s.pending), self.chunk, int(room[d]))
      if n:
        fed[s.index], room[d] = n, room[d] - n
    return fed

  def call_arrays(self, rows: list[Slot], fed: dict[int, int], bucket: int) -> tuple:
    """A call's host arrays (``step_program.StepInputs`` less the key) over ``rows``, each
    feeding ``fed[row]`` tokens, ``bucket`` tokens per data shard: per flat token ``(index,
    tokens, positions, valid, offsets)``, per sample ``(sample_at, limit)``, per slot ``(streams,
    counters, temperature, top_p)``; and each row's sample (its place among the samples)."""
    per_shard, samples = self.num_slots // self.shards, self.samples(bucket)
    n = bucket * self.shards
    index, tokens, positions, offsets = (np.zeros(n, np.int32) for _ in range(4))
    valid = np.zeros(n, bool)
    sample_at, limit = (np.zeros(samples * self.shards, np.int32) for _ in range(2))
    used, sampled = np.zeros(self.shards, int), np.zeros(self.shards, int)
    where = []
    for s in rows:
      d, k = self.shard(s.index), fed[s.index]
      chunk = s.pending[:k] if s.state == PREFILL else s.generated[-1:]
      at = slice(d * bucket + used[d], d * bucket + used[d] + k)
      index[at], tokens[at], valid[at] = s.index - d * per_shard, chunk, True
      positions[at], offsets[at] = s.length + np.arange(k), np.arange(k)
      j = d * samples + sampled[d]
      sample_at[j], limit[j] = used[d] + k - 1, self.limit(s, k)
      used[d], sampled[d] = used[d] + k, sampled[d] + 1
      where.append(j)
    slots = (np.array([s.stream for s in self.slots], np.uint32),
             np.array([s.sampled for s in self.slots], np.int32),
             np.array([s.temperature for s in self.slots], np.float32),
             np.array([s.top_p for s in self.slots], np.float32))
    return (index, tokens, positions, valid, offsets), (sample_at, limit), slots, where

  def limit(self, s: Slot, n: int) -> int:
    """Tokens a row feeding ``n`` tokens may sample in a call: none while its prefill goes on
    after this call, else ``decode_steps``, its turn's remaining budget, and (paged) the
    positions its pages hold (``page_decoding_rows`` takes the loop's pages where free; the
    last sampled token is not written)."""
    if s.state == PREFILL and n < len(s.pending):
      return 0
    end = s.length + n   # the row's length once its tokens are in
    budget = (s.max_new - len(s.generated) if s.state == DECODE
              else min(self.max_new_tokens, self.max_len - end))
    held = len(s.pages) * self.page_size if self.page_size is not None else self.max_len
    return max(1, min(self.decode_steps, budget, held - end + 1))

  def fed(self, s: Slot, n: int, tokens, logprobs, finished: list) -> None:
    """The host's side of a row's part in a call: its ``n`` tokens (a chunk, or its last
    token) are in the cache, then ``tokens`` were sampled, each fed back on the device but the
    last. (Another process's row: placeholders but the last, ``Engine.readable``.)"""
    if s.state == PREFILL:
      s.pending, s.length, s.held = s.pending[n:], s.length + n, None
      self.stats.tokens_prefilled += n
      if s.pending:   # mid-prefill: nothing sampled
        return
      # Prompt done: its last logits gave the turn's first token.
      s.state, s.max_new = DECODE, min(self.max_new_tokens, self.max_len - s.length)
      self._sampled(s, tokens[0], logprobs[0], finished)
      tokens, logprobs = tokens[1:], logprobs[1:]
    for token, logprob in zip(tokens, logprobs):
      s.length += 1
      self.stats.tokens_decoded += 1
      self._sampled(s, token, logprob, finished)

  def _sampled(self, slot: Slot, token: int, logprob: float, finished: list) -> None:
    slot.generated.append(int(token))
    slot.logprobs.append(float(logprob))
    slot.sampled += 1
    stopped = int(token) in self.stop_ids
    if stopped or len(slot.generated) >= slot.max_new:
      slot.state = PARKED
      finished.append(self.turn(slot, stopped))

  def turn(self, slot: Slot, stopped: bool, failure: str | None = None) -> Turn:
    """``slot``'s finished turn; without its ids when another process reads its row."""
    mine = slot.index in self.readable
    return Turn(slot.index, list(slot.generated) if mine else None,
                list(slot.logprobs) if mine else None, stopped, slot.tag, failure)

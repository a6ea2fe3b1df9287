"""Multi-turn episodes on the engine, with sandbox work on host threads.

``EpisodeRunner`` owns an ``Engine``, a thread pool and a sandbox backend. ``submit`` reserves a
slot and starts the task's sandbox on a worker thread; from then on ``poll`` drives the episode:
prefill the prompt, decode a turn, hand the text to the agent protocol on a worker (the slot is
parked while the command runs, other slots keep decoding), prefill the observation, ... and
finally run the verifier on a worker. The slot is freed as soon as decoding is over, so the
verifier overlaps with the next episode's decoding.

Which rows share an engine call changes a row's floating-point rounding (the call's width and
attention span, the matmul blocking), and greedy or sampled tokens can flip on that. By default
sandbox results are taken as soon as they are ready, so a run depends on thread timing. With
``sandbox_steps = k > 0`` every sandbox operation's result is taken exactly ``k`` engine steps
after it was handed out (waiting for it if it is late), which makes the schedule, and so the
whole run, a deterministic function of its inputs and of what the sandboxes return (which can
vary by itself: the stages of a failing pipeline write to stderr in either order).

Multi-process (``owned`` and ``exchange``): every process runs the same runner over the same
engine, so its host bookkeeping (slots, the schedule, what each step computes) is replicated, but
a process runs the sandboxes of its ``owned`` slots only. The deterministic schedule is required:
at each engine step every process knows which sandbox results are due; each waits for its own,
the processes ``exchange`` them (an all-gather of small picklable values: prompt and observation
token ids, done flags, outcomes, error texts, and the turn the owner's engine sampled: a process
reads its own rows' tokens only, ``Engine.readable``) and all apply every due result in hand-out
order, so they stay identical without reading the clock.

In-flight version change (``switch_versions``, off by default; PipelineRL's idea for ES): an
episode's next turn decodes under the newest version ``poll`` was given, its member's noise
applied to those weights (``Scheduler.continue_turn(version=)``); ``EpisodeResult.turn_versions``
says which version decoded each turn.

Every sandbox handle the runner opened is closed by ``close()``, also after an exception.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Any, Callable, Sequence

from jaxes.rollout import chat
from jaxes.rollout.engine import Engine

SANDBOX_ERROR = "SANDBOX_ERROR"   # infrastructure (``protocol.SANDBOX_ERROR``): reward None, retried
CONTEXT_FULL = "CONTEXT_FULL"  # the KV-cache row is full: the episode ends, its verifier still runs
# (A paged engine's episode that finds no free KV page ends the same way, its failure the
# engine's reason, ``engine.PAGES_EXHAUSTED``; one whose prompt's pages are not free waits.)


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
  key: Any                       # the caller's id (a controller Job, an eval index, ...)
  task: Any                      # jaxes.envs.tasks.task.Task
  version: int
  member: int                    # -1: unperturbed
  stream: int                    # sampling stream: the same spec decodes the same tokens
  temperature: float = 0.0
  top_p: float = 1.0
  # This episode's protocol, ``make_episode(task, handle)``; None: the runner's. (Co-evolution
  # gives each member its own system prompt, ``jaxes.train.coevolution``.)
  make_episode: Callable[[Any, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
  spec: EpisodeSpec
  reward: float | None           # None: infrastructure failure (retry it)
  passed: bool
  turns: int
  failure: str | None            # a failure kind (protocol.FAILURES, CONTEXT_FULL, ...), or None
  truncated: bool                # ended because the cache row was full (or its KV pages ran out)
  env_s: float                   # worker seconds spent in the sandbox for this episode
  tokens: EpisodeStream | None = None  # what the engine fed and sampled (None: never started)
  error: str | None = None       # an infrastructure failure's text (its kind is ``failure``)
  turn_versions: tuple[int, ...] = ()  # the version whose weights decoded each assistant turn
                                       # (``spec.version`` unless ``switch_versions`` moved it)

  @property
  def last_version(self) -> int:
    """The version that decoded the episode's last turn (``spec.version`` before any turn)."""
    return self.turn_versions[-1] if self.turn_versions else self.spec.version


@dataclasses.dataclass(frozen=True)
class EpisodeStream:
  """An episode's token ids as the engine saw them: the prompt, then per assistant turn the
  sampled ids (with their behaviour log-probs) and, between turns, the observation that followed
  (``chat.observation_ids``). Known on every process of a multi-process run (prompt,
  observation and sampled ids travel in the exchange, the sampled ones from the row's owner)."""
  prompt: tuple[int, ...]
  turns: tuple[tuple[int, ...], ...]
  logprobs: tuple[tuple[float, ...], ...]
  observations: tuple[tuple[int, ...], ...]   # one fewer than turns


@dataclasses.dataclass
class _Live:
  spec: EpisodeSpec
  slot: int
  episode: Any = None
  handle: Any = None
  truncated: bool = False
  failure: str | None = None     # the engine's reason when it cut the episode short
  env_s: float = 0.0
  prompt: tuple = ()
  turns: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  observations: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)   # per turn: the version decoding it

  def stream(self) -> EpisodeStream | None:
    if not self.prompt:
      return None
    return EpisodeStream(self.prompt, tuple(self.turns), tuple(self.logprobs),
                         tuple(self.observations))


class _Remote:
  """Stands in for the future of sandbox work another process runs (its result comes from the
  exchange)."""


class EpisodeRunner:
  def __init__(self, engine: Engine, tokenizer, sandbox, *, make_episode, workers: int,
               sandbox_steps: int = 0, owned: Sequence[int] | None = None,
               exchange: Callable[[Any], list] | None = None, switch_versions: bool = False):
    """``make_episode(task, handle) -> protocol.Episode``. ``sandbox_steps``: see the module
    docstring (0 = as ready). ``owned``: the slots whose sandboxes this process runs (None:
    all); ``exchange(obj)``: every process's ``obj`` in process order
    (``jaxes.distributed.allgather_host``), required with ``owned``. ``switch_versions``: each
    next turn decodes under the newest version given to ``poll`` (module docstring)."""
    if sandbox_steps < 0:
      raise ValueError(f"sandbox_steps must be >= 0, got {sandbox_steps}")
    if (owned is None) != (exchange is None):
      raise ValueError("owned and exchange go together (a multi-process runner needs both)")
    if exchange is not None and not sandbox_steps:
      raise ValueError("a multi-process runner needs the deterministic schedule (sandbox_steps > 0): "
                       "processes must agree on when each sandbox result is taken")
    if switch_versions and engine.scheduler.member_slices:
      raise ValueError("switch_versions needs per-row members: under member_slices (full-rank "
                       "noise) a data shard runs one (version, member) at a time")
    self.switch_versions = switch_versions
    self.engine, self.tok, self.sandbox = engine, tokenizer, sandbox
    self.scheduler = engine.scheduler   # the slots: episodes start, continue and end there
    self._make_episode = make_episode
    self.sandbox_steps = sandbox_steps
    self._owned = None if owned is None else frozenset(owned)
    self._exchange = exchange
    self.steps = 0               # engine steps run by poll (the deterministic schedule's clock)
    self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
    # future (or _Remote) -> (kind, live, the step at which its result is taken when sandbox_steps > 0)
    self._futures: dict[cf.Future | _Remote, tuple[str, _Live, int]] = {}
    self._reserved: set[int] = set()
    self._waiting: list[EpisodeSpec] = []   # member slices: submitted, no slot yet (in order)
    self._reserved_for: dict[int, tuple] = {}  # member slices: reserved slot -> (version, member)
    self._admitting: list[_Live] = []  # paged engine: sandbox up, waiting for the prompt's pages
    self._handles: set = set()
    self.wait_s = 0.0            # main-thread time spent waiting for sandbox workers
    self.decode_s = 0.0          # main-thread time spent in engine steps, of which
    self.prefill_step_s = 0.0    # ... steps that carried prompt or observation tokens

  # -- worker functions (sandbox threads) -------------------------------------------------------
  def _start(self, live: _Live):
    t = time.perf_counter()
    handle = self.sandbox.start(live.spec.task)
    live.handle = handle
    self._handles.add(handle)
    live.episode = (live.spec.make_episode or self._make_episode)(live.spec.task, handle)
    live.env_s += time.perf_counter() - t

  def _act(self, live: _Live, text: str):
    t = time.perf_counter()
    done = live.episode.step(text)
    live.env_s += time.perf_counter() - t
    return done

  def _finish(self, live: _Live):
    t = time.perf_counter()
    try:
      return live.episode.finish()
    finally:
      self._close(live)
      live.env_s += time.perf_counter() - t

  def _close(self, live: _Live):
    if live.handle is not None:
      live.handle.close()
      self._handles.discard(live.handle)

  def _owns(self, live: _Live) -> bool:
    return self._owned is None or live.slot in self._owned

  def _spawn(self, kind: str, fn, live: _Live, *args) -> None:
    work = self._pool.submit(fn, live, *args) if self._owns(live) else _Remote()
    self._futures[work] = (kind, live, self.steps + self.sandbox_steps)

  # -- host API ---------------------------------------------------------------------------------
  def free_slots(self) -> list[int]:
    """Slots a new episode may be submitted for (with member slices: less those the waiting
    episodes will take; ``submit`` picks the slot)."""
    free = [i for i in self.scheduler.free_slots() if i not in self._reserved]
    return free[len(self._waiting):]

  def live_versions(self) -> set[int]:
    return self.scheduler.live_versions() | {live.spec.version for _, live, _ in self._futures.values()}

  def stats(self) -> dict[str, float]:
    """Cumulative counters: the runner's (engine-step seconds ``decode_s``, of which
    ``prefill_step_s`` in steps that carried prefill tokens, ``wait_s``, ``steps``) and the
    engine's (``EngineStats`` fields). Callers take differences of two snapshots for a window."""
    return {"decode_s": self.decode_s, "prefill_step_s": self.prefill_step_s, "wait_s": self.wait_s,
            "steps": self.steps, **dataclasses.asdict(self.engine.stats)}

  def idle(self) -> bool:
    return not self._futures and not self.scheduler.busy() and not self._reserved and not self._waiting

  def submit(self, spec: EpisodeSpec) -> None:
    free = self.free_slots()
    if not free:
      raise RuntimeError("submit: no free slot")
    if self.scheduler.member_slices:
      self._waiting.append(spec)
      self._place_waiting()
      return
    live = _Live(spec, free[0])
    self._reserved.add(live.slot)
    self._spawn("start", self._start, live)

  def _place_waiting(self) -> None:
    """Member slices (``Engine.member_slices``): each waiting episode, in order, takes a free slot
    of a data shard that runs its (version, member), else of a shard with no episode at all; the
    others wait until a shard of their member has room or a whole shard is free, so the members
    of a shard run in turn."""
    per_shard = self.engine.num_slots // self.engine.shards
    held = self.scheduler.slice_members()
    # Reserved slots (their sandboxes starting) are their episodes' already.
    self._reserved_for = {i: m for i, m in self._reserved_for.items() if i in self._reserved}
    for slot, member in self._reserved_for.items():
      held[slot // per_shard] = member
    free = [i for i in self.scheduler.free_slots() if i not in self._reserved]
    waiting, self._waiting = self._waiting, []
    for spec in waiting:
      member = (spec.version, spec.member)
      slot = next((i for i in free if held[i // per_shard] == member), None)
      if slot is None:
        slot = next((i for i in free if held[i // per_shard] is None), None)
      if slot is None:
        self._waiting.append(spec)
        continue
      free.remove(slot)
      held[slot // per_shard] = member
      live = _Live(spec, slot)
      self._reserved.add(slot)
      self._reserved_for[slot] = member
      self._spawn("start", self._start, live)

  def _result(self, live, outcome=None, error: str | None = None) -> EpisodeResult:
    if outcome is None or outcome.failure == SANDBOX_ERROR:
      return EpisodeResult(live.spec, None, False, getattr(outcome, "turns", 0), SANDBOX_ERROR,
                           live.truncated, live.env_s, live.stream(), error=error,
                           turn_versions=tuple(live.versions))
    failure = outcome.failure or ((live.failure or CONTEXT_FULL) if live.truncated else None)
    return EpisodeResult(live.spec, float(outcome.reward), bool(outcome.passed), int(outcome.turns),
                         failure, live.truncated, live.env_s, live.stream(),
                         turn_versions=tuple(live.versions))

  def _end(self, live: _Live, truncated: bool = False, failure: str | None = None):
    self.scheduler.release(live.slot)
    live.truncated, live.failure = truncated, failure
    self._spawn("finish", self._finish, live)

  def _admit(self, live: _Live) -> None:
    ok = self.scheduler.start(live.slot, list(live.prompt), version=live.spec.version,
                           member=live.spec.member, stream=live.spec.stream,
                           temperature=live.spec.temperature, top_p=live.spec.top_p, tag=live)
    if not ok:  # the prompt alone overflows the cache row
      live.truncated = True
      self._spawn("finish", self._finish, live)

  def _ready(self, block: bool, timeout: float) -> list[cf.Future]:
    """The futures whose results this poll takes, in hand-out order."""
    if not self.sandbox_steps:
      if block and not self.scheduler.busy() and self._futures:
        t = time.perf_counter()
        cf.wait(list(self._futures), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        self.wait_s += time.perf_counter() - t
      return [f for f in self._futures if f.done()]
    if self._futures and not self.scheduler.busy():
      # Nothing to decode: move the clock to the next result that is due.
      self.steps = max(self.steps, min(due for _, _, due in self._futures.values()))
    due = [f for f, (_, _, step) in self._futures.items() if step <= self.steps]
    t = time.perf_counter()
    cf.wait([f for f in due if isinstance(f, cf.Future)])
    self.wait_s += time.perf_counter() - t
    return due

  def _payload(self, kind: str, live: _Live, fut: cf.Future) -> tuple:
    """What a finished piece of sandbox work means to the engine, as small picklable values:
    ``(error text or None, value, env_s, turn)``; value: the prompt ids (start), ``(done,
    observation ids)`` (act) or the outcome (finish); turn: the episode's last ``(tokens,
    log-probs)`` as this owner's engine sampled them (None before the first), which the other
    processes' engines did not read."""
    turn = (live.turns[-1], live.logprobs[-1]) if live.turns else None
    error = fut.exception()
    if error is not None:
      return f"{SANDBOX_ERROR}: {type(error).__name__}: {error}", None, live.env_s, turn
    if kind == "start":
      value = chat.prompt_ids(self.tok, live.episode.messages)
    elif kind == "act":
      done = fut.result()
      value = (True, None) if done else (
          False, chat.observation_ids(self.tok, live.episode.messages[-1]["content"]))
    else:
      value = fut.result()
    return None, value, live.env_s, turn

  def _payloads(self, due: list) -> list[tuple]:
    """The payload of every due piece of work, in ``due``'s order: computed here for this
    process's own, taken from the exchange for the others'."""
    mine = {i: self._payload(*self._futures[f][:2], f) for i, f in enumerate(due)
            if isinstance(f, cf.Future)}
    if self._exchange is None:
      return [mine[i] for i in range(len(due))]
    merged = {}
    for part in self._exchange(mine):   # process order; each due index comes from its owner
      merged.update(part)
    if len(merged) != len(due):
      raise RuntimeError(f"sandbox exchange: {len(merged)} results for {len(due)} due pieces of "
                         f"work (the processes' schedules diverged)")
    return [merged[i] for i in range(len(due))]

  def poll(self, params_by_version: dict, block: bool = False, timeout: float = 1.0) -> list[EpisodeResult]:
    """Advance every episode once: take finished sandbox work, run one engine step. With
    ``block`` and nothing to decode, wait for sandbox work (up to ``timeout`` s). With
    ``sandbox_steps > 0`` the results due at this step are always waited for (the sandbox's own
    timeouts bound the wait) and ``block``/``timeout`` do not apply."""
    results = []
    due = self._ready(block, timeout)
    payloads = self._payloads(due) if due else []
    for fut, (error, value, env_s, turn) in zip(due, payloads):
      kind, live, _ = self._futures.pop(fut)
      live.env_s = env_s
      if turn is not None and not self._owns(live):   # the ids its owner's engine read
        live.turns[-1], live.logprobs[-1] = turn
      if kind == "start":
        self._reserved.discard(live.slot)
        if error is not None:
          self._close(live)
          results.append(self._result(live, error=error))
          continue
        live.prompt = tuple(value)
        if not self.scheduler.can_start(live.slot, len(value)):  # paged: wait for the prompt's pages
          self._reserved.add(live.slot)
          self._admitting.append(live)
          continue
        self._admit(live)
      elif kind == "act":
        if error is not None:
          self.scheduler.release(live.slot)
          self._close(live)
          results.append(self._result(live, error=error))
          continue
        done, observation = value
        # ``params_by_version`` holds every live row's version: the newest is never older.
        newest = max(params_by_version) if self.switch_versions else None
        if done:
          self._end(live)
        elif not self.scheduler.continue_turn(live.slot, observation, newest):
          self._end(live, truncated=True, failure=self.scheduler.slots[live.slot].failure)
        else:
          live.observations.append(tuple(observation))
      else:  # finish
        results.append(self._result(live, error=error) if error is not None
                       else self._result(live, value))
    if self._waiting:   # shards freed by this poll's releases
      self._place_waiting()
    for live in list(self._admitting):   # in submission order, as pages are free now
      if self.scheduler.can_start(live.slot, len(live.prompt)):
        self._admitting.remove(live)
        self._reserved.discard(live.slot)
        self._admit(live)
    if self.scheduler.busy():
      t, prefills = time.perf_counter(), self.engine.stats.prefill_calls
      turns = self.engine.step(params_by_version)
      self.steps += 1
      dt = time.perf_counter() - t
      self.decode_s += dt
      if self.engine.stats.prefill_calls > prefills:
        self.prefill_step_s += dt
      for turn in turns:
        live = turn.tag
        # Another process's row: its ids come with its owner's next result (``_payload``).
        live.turns.append(None if turn.tokens is None else tuple(turn.tokens))
        live.logprobs.append(None if turn.logprobs is None else tuple(turn.logprobs))
        live.versions.append(self.scheduler.slots[turn.slot].version)
        if turn.failure is not None:   # no free KV page for its next token: it ends here
          self._end(live, truncated=True, failure=turn.failure)
          continue
        if not self._owns(live):
          self._spawn("act", self._act, live, None)   # its owner decodes and runs it
          continue
        ids = turn.tokens[:-1] if turn.stopped else turn.tokens
        text = self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self._spawn("act", self._act, live, text)
    return results

  def close(self) -> None:
    """Stop all work and close every sandbox handle this runner opened (idempotent)."""
    for fut in self._futures:
      if isinstance(fut, cf.Future):
        fut.cancel()
    self._pool.shutdown(wait=True, cancel_futures=True)
    for handle in list(self._handles):
      handle.close()
    self._handles.clear()
    self._futures.clear()
    self._reserved.clear()
    self._waiting.clear()
    self._reserved_for.clear()
    self._admitting.clear()
    for i in range(self.engine.num_slots):
      self.scheduler.release(i)

"""Rollout engine throughput: row compaction (``Engine(compact=True)``, the default) against the
full-batch path (``compact=False``: every call runs all B rows), side by side in one run. A
compacted call runs the step on a quarter or a half of the rows (``attention.Rows``: its new
keys/values written into the cache in place, its key blocks read for its rows only); a call
that needs more rows runs the same full-batch program as ``compact=False``.

Async workloads also run a third engine, "merged": compaction plus ``ESPolicyBank(version_steps=)``,
which runs the rows of both live versions in one call (version 1 as version 0 plus the low-rank
SGD step of the update that made it, ``ESPolicyBank.add_step``) instead of a call per version.

Workloads, on one engine each, with a low-rank ES noiser (every slot its own member):

* ``mix``: a realistic mix — a fraction of the slots work (decode turns of ``--turn`` tokens;
  each finished turn is followed by a ``--obs``-token observation to prefill), the rest are
  parked (a sandbox command running). Sync: one live version; Async-1: the working slots
  alternate between two versions.
* ``decode``: every working slot decodes (no turn ends while timing), all B slots or a quarter
  (the others free).

Beside them, on engines of their own (compacting):

* ``engine_vs_plain_decode``: decode tokens/s of the engine over a plain jitted batched forward
  (``qwen2.forward`` with a dense KV cache of just the live rows, then the engine's sampler) of
  the same rows, prompts, noiser (the same low-rank members: the engine always perturbs, so a
  plain forward without it would measure the noiser, not the engine) and KV lengths, attending
  over the span the engine picks; all B rows (the headline number) and a quarter of them (the
  engine's compacted batch against a cache of those rows only). Each pair steps alternately,
  from the prefill on; ``same_tokens`` checks the two decoded the same tokens.
* ``observation_prefill_vs_full_step``: the step that prefills a ``--obs``-token observation into
  1 of B rows (the others parked) over the step in which all B rows prefill one, each timed at
  the same KV length (the rows start again from their prompt every cycle, untimed).

The engines of the sync and Async-1 mixes (all modes) step alternately, as do those of the two
decode workloads (same load on a shared machine, so the ratios compare like with like), each step
timed alone; the median step time is reported, steps during which an engine compiled left out
(their count is reported). Printed per workload and mode: tokens/s (prefilled + decoded tokens per second of
engine steps), the useful-token fraction (tokens fed per position computed), engine calls per
step. The last line is one JSON object with those and the ratios ``compact / full`` and
``two_versions_vs_one`` (per mode; "merged": the merged Async-1 step over the compact sync
step), ``quarter_rows_vs_full`` (step time), ``kv_bytes_in_use_vs_reserved``
(the sync mix at the end of timing: the dense cache's tokens held over B x max_len, and with
``--page_size`` (default 16) the "paged" mode's pages in use over its pages, half the dense
cache's by default: compaction over a paged KV cache, whose step time is reported beside the
dense compacted one as ``paged_vs_dense_step_time``).

  PYTHONPATH=. python benchmarks/engine_throughput.py --quick     # smoke run, about a minute
  PYTHONPATH=. nice -n 10 python benchmarks/engine_throughput.py  # ~22M parameters, 32 slots

``--quick`` is a smoke run, not for recorded numbers: a 0.5M-parameter model, prompts of 16
tokens, turns of 6, observations of 8, 6 + 24 steps and 6 observation cycles (the full run: 48,
12, 40, 10 + 40 and 20), still 32 slots and every mode and key. Engines decode up to
``--decode_steps`` (8) tokens per row per step on the device (``Engine(decode_steps=)``), so a
decode workload's rows hold ``prompt + steps x 8`` tokens by the end (below ``--max_len``).

``engine_vs_plain_decode`` and the two keys of the device loop compare, per engine step, K
decode tokens per row: ``host_syncs_per_token`` (the engine's host reads per decoded token of a
row; target <= 0.125) and ``host_overhead_vs_device_loop`` (engine decode tokens/s over a jitted
``lax.fori_loop`` of the same K plain decode steps on the same rows: the share of time the
engine's host work leaves to the device; target >= 0.9). Nearly all of its time is
compilation, so it keeps every KV length in the shortest attention span and every prefill in
one chunk width, and the plain forward's noiser is the engine's compiled program (loaded, not
compiled again). Measured on the 2-core CPU VM beside another agent's test run (2026-12-02):
5 min 27 s wall, 202 CPU-s before (load 1.6 -> 7.7); 2 min 10 s wall, 85 CPU-s after (load
6.6 -> 9.9; about a minute on an idle machine by its CPU time).
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxes import es
from jaxes.models import qwen2
from jaxes.rollout import sampling
from jaxes.rollout.engine import DECODE, FREE, PARKED, PREFILL, Engine
from jaxes.rollout.policy_bank import ESPolicyBank, VersionSteps

IM_END = 3


def build(quick: bool):
  if quick:
    cfg = qwen2.Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=4096)
  else:
    cfg = qwen2.Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=6,
                            num_heads=8, num_kv_heads=2, max_position_embeddings=4096)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def _bank(make_noiser, **kw):
  """The engines' policy bank: each row its member's noise (None: the plain bank)."""
  return None if make_noiser is None else ESPolicyBank(make_noiser, **kw)


def _engine(args, cfg, graphdef, make_noiser, params_by_version, *, compact, versions, working,
            observations, steps=None, paged=False):
  """A fresh engine in the workload's starting state, and the rng its observations come from
  (seeded alike for every mode, so all run the same tokens). ``steps``: ``(VersionSteps, cohort
  of the update 0 -> 1)`` for the merged mode; ``paged``: a paged KV cache (the paged mode)."""
  B = args.slots
  engine = Engine(graphdef, cfg, num_slots=B, max_len=args.max_len, prefill_chunk=args.chunk,
                  max_new_tokens=args.turn if observations else args.max_len - args.prompt - 1,
                  stop_ids=[],
                  im_end_id=IM_END, compact=compact, decode_steps=args.decode_steps,
                  policy=_bank(make_noiser, version_steps=None if steps is None else steps[0]),
                  **(dict(page_size=args.page_size, num_pages=args.num_pages) if paged else {}))
  if steps is not None:
    assert engine.policy.add_step(1, *steps[1])
  rng = np.random.default_rng(0)
  active = set(range(0, B, B // working)) if working < B else set(range(B))
  # The mix: every slot has had a turn, the idle ones stay parked. Decode: idle slots are free.
  for i in (range(B) if observations else sorted(active)):
    engine.scheduler.start(i, list(rng.integers(4, cfg.vocab_size, size=args.prompt)),
                 version=(i // (B // working)) % versions if i in active else 0, member=i,
                 stream=i, temperature=0.7)
  if observations:
    while any(s.state != PARKED for s in engine.scheduler.slots):
      engine.step(params_by_version)
    for i in active:
      engine.scheduler.continue_turn(i, list(rng.integers(4, cfg.vocab_size, size=args.obs)))
  return engine, rng


def run(args, cfg, graphdef, make_noiser, params_by_version, steps, workloads):
  """Workloads whose ratios are reported (sync and Async-1 mixes; all and a quarter of the rows
  decoding), each on fresh engines per mode (full batch, compaction; with two versions also
  merged), all stepping alternately so every engine sees the same machine load; per (workload,
  mode) the median step time and the counters of timed steps."""
  engines = {}
  for name, workload in workloads.items():
    modes = ("full", "compact") + (("merged",) if workload["versions"] > 1 and steps else ()) + (
        ("paged",) if args.page_size else ())   # paged: compaction over a paged KV cache
    for mode in modes:
      engines[name, mode] = _engine(args, cfg, graphdef, make_noiser, params_by_version,
                                    compact=mode != "full", paged=mode == "paged",
                                    steps=steps if mode == "merged" else None, **workload)
  times = {key: [] for key in engines}
  keep = {key: [] for key in engines}
  base = {}
  for n in range(args.warm + args.steps):
    for key, (engine, rng) in engines.items():
      if n == args.warm:
        base[key] = dict(vars(engine.stats))
      compiled = engine.compilations()
      t = time.perf_counter()
      turns = engine.step(params_by_version)
      dt = time.perf_counter() - t
      if n >= args.warm:
        times[key].append(dt)
        keep[key].append(engine.compilations() == compiled)
      for turn in turns:
        if workloads[key[0]]["observations"]:
          engine.scheduler.continue_turn(turn.slot, list(rng.integers(4, cfg.vocab_size, size=args.obs)))
  out = {name: {} for name in workloads}
  for (name, mode), (engine, _) in engines.items():
    stats = {k: v - base[name, mode][k] for k, v in vars(engine.stats).items()}
    t, k = np.array(times[name, mode]), np.array(keep[name, mode])
    tokens = stats["tokens_prefilled"] + stats["tokens_decoded"]
    # Timed steps that compiled are left out of the time; the median resists load spikes.
    step_s = float(np.median(t[k])) if k.any() else float("nan")
    out[name][mode] = {
      "step_ms": 1e3 * step_s,
      "tokens_per_s": tokens / len(t) / step_s,
      "useful_fraction": tokens / stats["positions_computed"],
      "calls_per_step": (stats["prefill_calls"] + stats["decode_calls"]) / stats["busy_steps"],
      "multi_version_calls": stats["multi_version_calls"],
      "rows_computed_per_step": stats["rows_computed"] / stats["busy_steps"],
      "timed_steps": int(k.sum()), "steps_that_compiled": int((~k).sum()),
      # Dense: the tokens held vs B x max_len; paged: pages held vs pages allocated.
      "kv_bytes_in_use": engine.kv_bytes()["in_use"],
      "kv_bytes_reserved": engine.kv_bytes()["reserved"],
    }
  return out


def _plain_step(graphdef, attend_len, params, noiser, cache, tokens, positions, valid, key,
                streams, counters, temperature, top_p):
  """The reference step: ``qwen2.forward`` over a cache of just the live rows, then the engine's
  sampler (the same tokens and log-probs for the same keys), nothing else. Returns the next
  step's inputs (each row's token, position and sampling counter) beside the log-probs and the
  cache, so the loop's state stays on the device."""
  last = jnp.maximum(valid.sum(axis=1) - 1, 0)
  logits, cache = qwen2.forward(graphdef, params, tokens, positions, valid, cache=cache,
                                noiser=noiser,
                                options=qwen2.Options(logits_at=last, attend_len=attend_len))
  next_tokens, logprobs = sampling.sample_with_logprob(
      logits, sampling.row_keys(key, streams, counters), temperature, top_p)
  return next_tokens[:, None], positions[:, -1:] + 1, counters + 1, logprobs, cache


def _one_plain_step(graphdef, attend_len, params, noiser, cache, state, valid, key, streams,
                    temperature, top_p):
  """``_plain_step`` over ``state = (tokens, positions, counters)``: returns (state, cache)."""
  tokens, positions, counters = state
  tokens, positions, counters, _, cache = _plain_step(
      graphdef, attend_len, params, noiser, cache, tokens, positions, valid, key, streams,
      counters, temperature, top_p)
  return (tokens, positions, counters), cache


def _plain_loop(graphdef, attend_len, steps, params, noiser, cache, state, valid, key, streams,
                temperature, top_p):
  """``steps`` plain decode steps in one ``lax.fori_loop``, the device-only reference: returns
  (state, cache, the sampled tokens [n, steps])."""
  def body(i, carry):
    state, cache, sampled = carry
    state, cache = _one_plain_step(graphdef, attend_len, params, noiser, cache, state, valid, key,
                                   streams, temperature, top_p)
    return state, cache, sampled.at[:, i].set(state[0][:, 0])

  return jax.lax.fori_loop(0, steps, body,
                           (state, cache, jnp.zeros((state[0].shape[0], steps), jnp.int32)))


class _PlainDecode:
  """The engine's live rows (started, not stepped yet) decoded by a plain jitted batched forward
  (``_plain_step``): the same prompts, members (the same low-rank noiser: ``all_members``, built
  once for member i in row i of all B rows, or its live rows), sampling streams and
  temperatures, a dense cache of those rows only, and attention over the span the engine picks
  (the shortest of ``engine.spans`` that holds every row), so the two compute the same tokens and
  differ only in the engine's host bookkeeping."""

  def __init__(self, engine, graphdef, cfg, all_members, params, max_len):
    rows = [s for s in engine.scheduler.slots if s.state == PREFILL]
    n, width = len(rows), len(rows[0].pending)
    assert all(len(s.pending) == width for s in rows)
    assert all(s.version == 0 and s.member == s.index for s in rows)   # all_members' rows
    ids = lambda f, dtype: jnp.asarray(np.array([f(s) for s in rows], dtype))
    take = np.array([s.index for s in rows])
    self.noiser = None if all_members is None else (
        all_members if n == len(engine.scheduler.slots) else
        jax.jit(lambda noiser: noiser.select_rows(lambda x: x[take]))(all_members))
    self.params, self.spans, self.key = params, engine.spans, engine.base_key
    self.sampling = (ids(lambda s: s.stream, np.uint32), jnp.zeros(n, jnp.int32),
                     ids(lambda s: s.temperature, np.float32), ids(lambda s: s.top_p, np.float32))
    self.cache = jax.jit(functools.partial(qwen2.KVCache.init, cfg, n, max_len))()
    self.tokens = ids(lambda s: s.pending, np.int32)
    self.positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (n, width))
    self.decoding = jnp.ones((n, 1), bool)
    self.length, self.shapes, self.sampled = 0, set(), []
    self.fn = jax.jit(functools.partial(_one_plain_step, graphdef), static_argnums=0,
                      donate_argnums=(3,))
    self.loop = jax.jit(functools.partial(_plain_loop, graphdef), static_argnums=(0, 1),
                        donate_argnums=(4,))

  def step(self, tokens: int = 1, loop: bool = False) -> bool:
    """``tokens`` tokens per row: the first by the prompt's prefill if it is not done (as the
    engine's first call samples), the rest by decode steps (``_decode``). True when it compiled."""
    fresh = False
    if self.tokens.shape[1] > 1:
      fresh, tokens = self._decode(1), tokens - 1
    return (self._decode(tokens, loop) if tokens else False) or fresh

  def _decode(self, tokens: int, loop: bool = False) -> bool:
    """The prompt's prefill (one token sampled), or ``tokens`` decode steps: dispatched one by
    one (``loop`` False), or as one jitted ``lax.fori_loop`` of them (the device loop: no host
    work between steps); waited for. True when it compiled."""
    width = self.tokens.shape[1]
    if width > 1:
      tokens = 1
    span = next((a for a in self.spans if a >= self.length + width + tokens - 1), self.spans[-1])
    valid = self.decoding if width == 1 else jnp.ones(self.tokens.shape, bool)
    streams, counters, temperature, top_p = self.sampling
    state = (self.tokens, self.positions, counters)
    if loop and width == 1:
      state, self.cache, sampled = self.loop(span, tokens, self.params, self.noiser, self.cache,
                                             state, valid, self.key, streams, temperature, top_p)
    else:
      sampled = []
      for _ in range(tokens):
        state, self.cache = self.fn(span, self.params, self.noiser, self.cache, state, valid,
                                    self.key, streams, temperature, top_p)
        sampled.append(state[0])
      sampled = jnp.concatenate(sampled, axis=1)
    self.tokens, self.positions, counters = state
    jax.block_until_ready(sampled)
    self.sampled.append(sampled)
    self.sampling = (streams, counters, temperature, top_p)
    self.length += width + tokens - 1
    fresh = (width, span, tokens, loop) not in self.shapes
    self.shapes.add((width, span, tokens, loop))
    return fresh


def engine_vs_plain(args, cfg, graphdef, make_noiser, params):
  """Decode tokens/s of the engine (compacting; ``--decode_steps`` K tokens per row per step)
  over the plain forward of the same live rows (all B slots, and a quarter of them with the rest
  free) — dispatched step by step ("plain") and as one jitted ``lax.fori_loop`` of K steps
  ("device_loop": the host does nothing between steps, so engine / device loop is the host's
  share) — all stepping alternately from the prefill of the same prompts on (so every step of a
  group is at the same KV lengths), each step timed alone; steps that compiled left out, medians.
  Also the engine's host syncs (device reads) per decoded token of a row."""
  B, K, groups, all_members = args.slots, args.decode_steps, {}, None
  # Engine steps: the prefill, one warm decode step, then as many as the turn budget allows.
  timed = max(3, min(args.steps, (args.max_len // 2 - args.prompt) // K - 2))
  for working in (B, B // 4):
    # im_end_id out of the vocabulary: no turn ends while timing, every live row decodes.
    engine = Engine(graphdef, cfg, num_slots=B, max_len=args.max_len, prefill_chunk=args.chunk,
                    max_new_tokens=args.max_len // 2, stop_ids=[], im_end_id=cfg.vocab_size,
                    policy=_bank(make_noiser), decode_steps=K,
                    # every prompt in the first call, as the plain reference prefills them
                    prefill_tokens=max(B * args.prompt, args.chunk))
    rng = np.random.default_rng(0)
    for i in range(0, B, B // working):
      engine.scheduler.start(i, list(rng.integers(4, cfg.vocab_size, size=args.prompt)), version=0,
                   member=i, stream=i, temperature=0.7)
    if make_noiser is not None and all_members is None:
      # Member i in row i of all B rows, jitted as the engine jits it (the same shardings): its
      # compiled program is loaded from the run's cache, not compiled again (it is slow to).
      build_noiser = jax.jit(make_noiser, in_shardings=(engine.param_shardings, *3 * (engine.rows,)),
                             out_shardings=engine.policy.noiser_shardings)
      slots = np.arange(B, dtype=np.int32)
      all_members = build_noiser(params, np.zeros(B, np.int32), slots, slots)
    groups[working] = (engine, *(_PlainDecode(engine, graphdef, cfg, all_members, params,
                                              args.max_len) for _ in range(2)))
  sides = ("engine", "plain", "device_loop")
  times = {(w, side): [] for w in groups for side in sides}
  syncs = {w: [0, 0] for w in groups}   # timed engine steps' host syncs, tokens of a row
  for n in range(2 + timed):
    for w, (engine, plain, loop) in groups.items():
      compiled, before = engine.compilations(), dict(vars(engine.stats))
      t = time.perf_counter()
      engine.step({0: params})
      dt = time.perf_counter() - t
      if n >= 2 and engine.compilations() == compiled:
        times[w, "engine"].append(dt)
        syncs[w][0] += engine.stats.host_syncs - before["host_syncs"]
        syncs[w][1] += (engine.stats.tokens_decoded - before["tokens_decoded"]) / w
      for side, ref in (("plain", plain), ("device_loop", loop)):
        t = time.perf_counter()
        fresh = ref.step(K, loop=side == "device_loop")
        dt = time.perf_counter() - t
        if n >= 2 and not fresh:
          times[w, side].append(dt)
  out = {}
  for w, (engine, plain, loop) in groups.items():
    e, p, d = (float(np.median(times[w, side])) for side in sides)
    live = [s for s in engine.scheduler.slots if s.state != FREE]
    assert all(s.state == FREE or (s.state == DECODE and len(s.generated) == K * (2 + timed))
               for s in engine.scheduler.slots)   # every live row decoded at every step: no turn ended
    got = np.array([s.generated for s in live])
    out["all_rows" if w == args.slots else "quarter_rows"] = {
        "rows": w, "tokens_per_row_per_step": K, "engine_step_ms": 1e3 * e,
        "plain_step_ms": 1e3 * p, "device_loop_step_ms": 1e3 * d,
        "engine_tokens_per_s": w * K / e, "plain_tokens_per_s": w * K / p,
        "device_loop_tokens_per_s": w * K / d, "engine_vs_plain": p / e,
        "engine_vs_device_loop": d / e,
        "host_syncs_per_token": syncs[w][0] / syncs[w][1],
        "timed_steps": [len(times[w, side]) for side in sides],
        # each reference decodes the engine's tokens (a float difference may flip a sampled one)
        "same_tokens": [float(np.mean(np.concatenate([np.asarray(t) for t in ref.sampled], axis=1)
                                      == got)) for ref in (plain, loop)]}
  return out


def observation_prefill(args, cfg, graphdef, make_noiser, params):
  """A step that prefills one ``--obs``-token observation into 1 of B rows (the others parked)
  over a step in which all B rows prefill one (the full-width step), on two compacting engines
  stepping alternately. Every cycle starts the rows again from their prompt (untimed, so each
  timed step is at the same KV length) and times the observation's step alone; medians."""
  B = args.slots
  prompts = [list(np.random.default_rng(i).integers(4, cfg.vocab_size, size=args.prompt))
             for i in range(B)]
  engines = {}
  for rows in (1, B):   # max_new_tokens=1: the step that prefills the observation parks the row
    engines[rows] = Engine(graphdef, cfg, num_slots=B, max_len=args.max_len,
                           prefill_chunk=args.chunk, max_new_tokens=1, stop_ids=[],
                           im_end_id=IM_END, policy=_bank(make_noiser))
  rng = np.random.default_rng(1)
  times = {rows: [] for rows in engines}
  calls = {rows: set() for rows in engines}
  for n in range(2 + args.obs_cycles):   # two warm-up cycles
    for rows, engine in engines.items():
      for i in range(B if n == 0 else rows):
        if engine.scheduler.slots[i].state != FREE:
          engine.scheduler.release(i)
        engine.scheduler.start(i, prompts[i], version=0, member=i, stream=i, temperature=0.7)
      while engine.scheduler.busy():
        engine.step({0: params})
      for i in range(rows):
        assert engine.scheduler.continue_turn(i, list(rng.integers(4, cfg.vocab_size, size=args.obs)))
      before, compiled = dict(vars(engine.stats)), engine.compilations()
      t = time.perf_counter()
      engine.step({0: params})
      dt = time.perf_counter() - t
      if n >= 2 and engine.compilations() == compiled:
        times[rows].append(dt)
        d = {k: v - before[k] for k, v in vars(engine.stats).items()}
        calls[rows].add((d["prefill_calls"] + d["decode_calls"], d["rows_computed"],
                         d["positions_computed"] // d["rows_computed"]))
  one, full = (float(np.median(times[rows])) for rows in (1, B))
  return {"one_row_ms": 1e3 * one, "all_rows_ms": 1e3 * full, "ratio": one / full,
          "timed_cycles": [len(times[rows]) for rows in (1, B)],
          # (calls, rows computed, width) of the timed steps
          "calls": {"one_row": sorted(calls[1]), "all_rows": sorted(calls[B])}}


def programs_paper_config() -> int:
  """The programs ``python -m jaxes.preflight --config=configs/paper.py:async1,v5p-64`` lowers
  (abstract, nothing compiled): it names them all when ``--only`` selects none."""
  from jaxes import preflight
  from jaxes.train.config import load_config_file
  config = load_config_file("configs/paper.py", "async1,v5p-64")
  with tempfile.TemporaryDirectory() as stand_in:
    config = preflight.with_stand_in_checkpoint(config, stand_in)
    try:
      preflight.plan(config, preflight.resolve_topology("v5p-64"), log=lambda *_: None,
                     only="^$")
    except preflight.NoProgramMatches as e:
      return len(str(e).split(": ", 1)[1].split(", "))
  raise RuntimeError("a program named '' matched")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true",
                  help="smoke run, not for recorded numbers: the tiny model (0.5M parameters), "
                       "short prompts, turns and observations (every KV length in the shortest "
                       "attention span, so few programs compile) and few steps; under 2 minutes")
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--working", type=int, default=8, help="slots that work in the mix")
  ap.add_argument("--max_len", type=int, default=512)
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (48; --quick: 16)")
  ap.add_argument("--obs", type=int, default=None, help="observation tokens (40; --quick: 8)")
  ap.add_argument("--turn", type=int, default=None, help="tokens per turn (12; --quick: 6)")
  ap.add_argument("--warm", type=int, default=None, help="untimed steps (10; --quick: 6)")
  ap.add_argument("--steps", type=int, default=None, help="timed steps (40; --quick: 24)")
  ap.add_argument("--obs_cycles", type=int, default=None,
                  help="timed observation prefills per engine (observation_prefill_vs_full_step; "
                       "20; --quick: 6)")
  ap.add_argument("--page_size", type=int, default=16,
                  help="the paged mode's page size (0: no paged mode)")
  ap.add_argument("--num_pages", type=int, default=0,
                  help="the paged mode's pages (0: half the dense cache's slots x max_len)")
  ap.add_argument("--decode_steps", type=int, default=8,
                  help="the engines' decode steps per width-1 call (Engine(decode_steps=))")
  ap.add_argument("--noiser", choices=("lowrank", "none"), default="lowrank",
                  help="every slot its own low-rank ES member, or plain inference")
  args = ap.parse_args()
  # --quick: its time is compilation (each (rows, width, span) program of each step function:
  # dense, paged, merged versions, and the plain forward), not stepping. Short sequences keep
  # every KV length in the shortest span and every prefill in one chunk width: one span and
  # two widths per step function instead of up to three of each.
  defaults = (dict(prompt=16, obs=8, turn=6, warm=6, steps=24, obs_cycles=6) if args.quick else
              dict(prompt=48, obs=40, turn=12, warm=10, steps=40, obs_cycles=20))
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  # The decode workloads' rows decode up to decode_steps tokens per step and must not end.
  if args.prompt + (args.warm + args.steps) * args.decode_steps >= args.max_len:
    ap.error(f"--prompt + (--warm + --steps) x --decode_steps = {args.prompt} + "
             f"{args.warm + args.steps} x {args.decode_steps} must be below --max_len={args.max_len}")
  if args.page_size and not args.num_pages:
    args.num_pages = args.slots * args.max_len // args.page_size // 2
  # Every engine jits its own functions, and the modes share many programs: a compilation cache
  # for this run only (removed at exit) compiles each program once.
  xla_cache = tempfile.TemporaryDirectory(prefix="engine_throughput_xla_")
  jax.config.update("jax_compilation_cache_dir", xla_cache.name)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  cfg, graphdef, params = build(args.quick)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  strategy = es.Strategy(population=args.slots, sigma=0.02, learning_rate=0.1, mode="lowrank", rank=1)
  state0 = strategy.init(params, jax.random.key(0))
  results = [(0, m, float(m % 5)) for m in range(args.slots)]
  state1, _ = strategy.update(state0, results)
  params_by_version = {0: state0.params, 1: state1.params}
  steps = None
  if args.noiser == "lowrank":   # version 1 = version 0 + the step of that update
    steps = (VersionSteps(strategy.version_step(params, state0.run_key), strategy.population, 1),
             strategy.cohort(state0, results))

  def make_noiser(p, v, m, g):   # one function for every engine: they share its compiled build
    return strategy.member_noiser(p, v, m, g, run_key=state0.run_key)
  make_noiser = make_noiser if args.noiser == "lowrank" else None

  workloads = {
    "mix_sync": dict(versions=1, working=args.working, observations=True),
    "mix_async1": dict(versions=2, working=args.working, observations=True),
    "decode_all_rows": dict(versions=1, working=args.slots, observations=False),
    "decode_quarter_rows": dict(versions=1, working=args.slots // 4, observations=False),
  }
  results = {}
  for pair in (("mix_sync", "mix_async1"), ("decode_all_rows", "decode_quarter_rows")):
    results.update(run(args, cfg, graphdef, make_noiser, params_by_version, steps,
                       {name: workloads[name] for name in pair}))
  plain = engine_vs_plain(args, cfg, graphdef, make_noiser, state0.params)
  obs = observation_prefill(args, cfg, graphdef, make_noiser, state0.params)
  for name in workloads:
    for mode, r in results[name].items():
      print(f"{name:20s} {mode:8s} step {r['step_ms']:8.2f} ms  "
            f"{r['tokens_per_s']:8.1f} tok/s  useful {r['useful_fraction']:.3f}  "
            f"calls/step {r['calls_per_step']:.2f}  rows/step {r['rows_computed_per_step']:.1f}  "
            f"(timed {r['timed_steps']}, compiled in {r['steps_that_compiled']})", flush=True)
  for name, r in plain.items():
    print(f"decode {name:14s} engine {r['engine_step_ms']:8.2f} ms  plain forward "
          f"{r['plain_step_ms']:8.2f} ms  device loop {r['device_loop_step_ms']:8.2f} ms  "
          f"engine/plain tok/s {r['engine_vs_plain']:.3f}  engine/device loop "
          f"{r['engine_vs_device_loop']:.3f}  host syncs/token {r['host_syncs_per_token']:.3f}",
          flush=True)
  print(f"observation of {args.obs} tokens into 1 of {args.slots} rows {obs['one_row_ms']:.2f} ms, "
        f"into all rows {obs['all_rows_ms']:.2f} ms: {obs['ratio']:.3f}  {obs['calls']}", flush=True)
  for name, by in results.items():
    by["compact_vs_full_tokens_per_s"] = by["compact"]["tokens_per_s"] / by["full"]["tokens_per_s"]
    by["compact_vs_full_step_time"] = by["compact"]["step_ms"] / by["full"]["step_ms"]
    if "merged" in by:
      by["merged_vs_compact_step_time"] = by["merged"]["step_ms"] / by["compact"]["step_ms"]
    if "paged" in by:
      by["paged_vs_compact_step_time"] = by["paged"]["step_ms"] / by["compact"]["step_ms"]

  def ratio(a, b, mode):
    return results[a][mode]["step_ms"] / results[b][mode]["step_ms"]

  mix = results["mix_sync"]["compact"]
  paged = results["mix_sync"].get("paged")
  summary = {
    "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "params": int(n_params), "slots": args.slots, "working_in_mix": args.working,
    "quick": args.quick, "noiser": args.noiser,
    "two_versions_vs_one": {
        **{m: ratio("mix_async1", "mix_sync", m) for m in ("full", "compact")},
        **({"merged": results["mix_async1"]["merged"]["step_ms"] / mix["step_ms"]} if steps else {})},
    "decode_steps": args.decode_steps, "programs_paper_config": programs_paper_config(),
    "host_syncs_per_token": plain["all_rows"]["host_syncs_per_token"],
    "host_overhead_vs_device_loop": plain["all_rows"]["engine_vs_device_loop"],
    "host_overhead_vs_device_loop_quarter_rows": plain["quarter_rows"]["engine_vs_device_loop"],
    "engine_vs_plain_decode": plain["all_rows"]["engine_vs_plain"],
    "engine_vs_plain_decode_quarter_rows": plain["quarter_rows"]["engine_vs_plain"],
    "observation_prefill_vs_full_step": obs["ratio"],
    "plain_decode": plain, "observation_prefill": obs,
    "quarter_rows_vs_full": {m: ratio("decode_quarter_rows", "decode_all_rows", m)
                             for m in ("full", "compact")},
    # The sync mix at the end of timing: the paged cache's pages in use / allocated, beside the
    # dense cache's tokens held / B x max_len (and the bytes of each).
    "kv_bytes_in_use_vs_reserved": {
        "dense": mix["kv_bytes_in_use"] / mix["kv_bytes_reserved"],
        "dense_bytes": [mix["kv_bytes_in_use"], mix["kv_bytes_reserved"]],
        **({"paged": paged["kv_bytes_in_use"] / paged["kv_bytes_reserved"],
            "paged_bytes": [paged["kv_bytes_in_use"], paged["kv_bytes_reserved"]],
            "paged_reserved_vs_dense": paged["kv_bytes_reserved"] / mix["kv_bytes_reserved"],
            "page_size": args.page_size} if paged else {})},
    "paged_vs_dense_step_time": {name: by["paged_vs_compact_step_time"]
                                 for name, by in results.items() if "paged" in by},
    "workloads": results,
  }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()

"""The run ``jaxes.measure`` measures: the config as measured, its decode modes and their steady
decode, timed.

The config as measured is ES at a Qwen2.5 shape (``SHAPES``) with at least ``MIN_LIVE_MEMBERS``
slots, each its own member. A mode is that config varied: ``plain`` (no noiser), ``lowrank`` (every slot its own
member), ``fullrank`` (member slices; only where the config's ``es.mode`` is "full") and
``two_versions`` (half the rows a version newer, as an async run decodes them). Each mode's engine
decodes rows of random ``PROMPT_TOKENS``-token prompts to the end of their turn, again and again;
the timings and counters count the decode-only steps (a step that prefilled or compiled is left
out, counted).
"""
from __future__ import annotations

import statistics
import time

from jaxes.train import builders
from jaxes.train.algorithms import evolution

SHAPES = {"tiny": None, "0.5B": "qwen2.5-0.5b", "1.5B": "qwen2.5-1.5b", "7B": "qwen2.5-7b"}
MIN_LIVE_MEMBERS = 64     # ES low-rank mode decodes at least this many distinct members at once
PROMPT_TOKENS = 16        # each row's prompt; then it decodes to the end of its cache row


def measure_config(config, model_shape: str, num_devices: int):
  """The config as measured: ES (a GRPO config's ES counterpart), the Qwen2.5 shape (bfloat16;
  ``tiny``: the config's own model), at least ``MIN_LIVE_MEMBERS`` slots and a population with a
  member per slot, and rows that decode to the end of their cache row."""
  if model_shape not in SHAPES:
    raise ValueError(f"--model_shape={model_shape!r}: one of {', '.join(SHAPES)}")
  c = config.copy_and_resolve_references()
  c.train.algorithm = "es"
  preset = SHAPES[model_shape]
  if preset is not None and not c.model.path:
    c.model.preset = preset
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads"):
      c.model[key] = 0
    c.model.dtype = c.model.param_dtype = "bfloat16"
  data = builders.mesh_shape(c, num_devices)[0]
  slots = max(int(c.rollout.num_slots), MIN_LIVE_MEMBERS)
  c.rollout.num_slots = -(-slots // data) * data
  c.es.population = max(int(c.es.population), int(c.rollout.num_slots))
  c.rollout.max_new_tokens = int(c.rollout.max_len) - PROMPT_TOKENS - 1
  return c


def modes(config) -> dict:
  """Mode name -> (its config, ES or not). ``two_versions`` is an async run one version behind."""
  def variant(mode=None, controller="sync"):
    c = config.copy_and_resolve_references()
    if mode:
      c.es.mode = mode
    c.controller.mode = controller
    c.controller.max_staleness = max(1, int(c.controller.max_staleness)) if controller == "async" else 0
    return c
  out = {"plain": (variant(), False), "lowrank": (variant("lowrank"), True)}
  if config.es.mode == "full":
    out["fullrank"] = (variant("full"), True)
  out["two_versions"] = (variant(controller="async"), True)
  return out


def run_mode(config) -> str:
  """The mode that is the config's own run (its memory is the one the preflight predicts)."""
  if config.controller.mode == "async" and int(config.controller.max_staleness) >= 1:
    return "two_versions"
  return "fullrank" if config.es.mode == "full" else "lowrank"


def build_engine(config, model, es_mode: bool, mesh, run_key):
  """A mode's engine on the devices (``es_mode``: an ES policy bank under ``run_key``)."""
  policy = (evolution.es_policy_bank(config, model, evolution.build_strategy(config), run_key)
            if es_mode else None)
  # No tokenizer, as the preflight builds its engines (the same programs: the stop ids are part of
  # them): token 0 ends a turn, which random weights rarely sample; such a row starts again.
  return builders.build_engine(config, model, None, policy, mesh=mesh, abstract=False)


def _start_row(engine, config, i: int, version: int, member: int, rng, vocab: int) -> None:
  prompt = [int(t) for t in rng.integers(1, vocab, size=PROMPT_TOKENS)]
  if not engine.scheduler.start(i, prompt, version=version, member=member, stream=i,
                      temperature=float(config.rollout.temperature), top_p=float(config.rollout.top_p)):
    raise RuntimeError(f"measure: slot {i} refused a {PROMPT_TOKENS}-token prompt")


def decode(engine, config, params_by_version: dict, versions, members, steps: int, rng, vocab,
            after_step=lambda: None) -> dict:
  """``steps`` decode-only engine steps (every row starts, prefills, decodes to the end of its
  turn, starts again); the timings and counters of the decode-only steps. ``after_step`` runs
  after each step, untimed."""
  timed, skipped, walls, waits = 0, 0, [], []
  tokens = loop_steps = calls = 0
  kv_in_use = []
  while timed < steps:
    for i in engine.scheduler.free_slots():
      _start_row(engine, config, i, versions[i], members[i], rng, vocab)
    before = (engine.stats.prefill_calls, engine.stats.tokens_decoded, engine.stats.device_wait_s,
              engine.stats.loop_steps, engine.compilations(), engine.stats.decode_calls)
    kv = engine.kv_bytes()
    t = time.perf_counter()
    finished = engine.step(params_by_version)
    wall = time.perf_counter() - t
    after_step()
    for turn in finished:
      engine.scheduler.release(turn.slot)
    if engine.stats.prefill_calls != before[0] or engine.compilations() != before[4]:
      skipped += 1
      continue
    timed += 1
    walls.append(wall)
    waits.append(engine.stats.device_wait_s - before[2])
    tokens += engine.stats.tokens_decoded - before[1]
    calls += engine.stats.decode_calls - before[5]
    loop_steps += engine.stats.loop_steps - before[3]
    kv_in_use.append(kv["in_use"] / max(kv["reserved"], 1))
  return {"steps": timed, "steps_left_out": skipped, "calls": calls,
          "multi_version_calls": engine.stats.multi_version_calls, "seconds": sum(walls), "tokens": tokens,
          "median_step_s": statistics.median(walls), "loop_steps": loop_steps,
          "host_gap_s": statistics.median(w - d for w, d in zip(walls, waits)),
          "kv_in_use_fraction": statistics.fmean(kv_in_use), "compiled_at_run_time": engine.compilations()}


def rows(engine, mode: str) -> tuple[list[int], list[int]]:
  """Each slot's (version, member): every slot its own member; member slices one per data shard;
  two versions alternate by slot (by data shard under member slices)."""
  B, D = engine.num_slots, engine.shards
  per_shard = B // D
  if engine.policy.member_slices:
    members = [i // per_shard for i in range(B)]
    versions = [(i // per_shard) % 2 if mode == "two_versions" else 0 for i in range(B)]
  else:
    members = list(range(B))
    versions = [i % 2 if mode == "two_versions" else 0 for i in range(B)]
  return versions, members


def cohort(strategy, rng) -> list[tuple[int, int, float]]:
  return [(0, m, float(rng.normal())) for m in range(strategy.population)]

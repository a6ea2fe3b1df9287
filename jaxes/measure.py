"""Measure a config's real programs on the devices at hand, beside the preflight's predictions.

  python -m jaxes.measure --config=configs/demo.py [--model_shape=tiny|0.5B|1.5B|7B] [--steps=N]
      [--json] [--config.rollout.num_slots=...]

On the devices JAX sees (GPU, TPU or CPU) it builds the config's run at a Qwen2.5 shape with random
weights (``model.path`` set: that checkpoint) through the trainer's builders, as
``jaxes.measure_decode`` sizes it, and:

1. compiles every program of the decode modes and the ES update as the trainer's start-up does
   (``precompile.compile_all``), cold, into the persistent cache; each program's first call then
   loads it from there, as a restarted run does, timed (``compile_s``: ``cold``, ``cached``);
2. runs each mode's steady decode (``jaxes.measure_decode``) for ``--steps`` engine steps;
3. memory: the devices' peak (``jaxes.sizing.peak_bytes_in_use``) after each program's first call
   of the config's own run, next to ``jaxes.preflight.plan`` of it on the same devices;
4. roofline: bytes a decode step must move per device (weights + live KV, ``jaxes.sizing``) over
   its time, against the chip's peak HBM bandwidth (``jaxes.sizing.PEAK_HBM``), beside the
   compiler's cost analysis; host gap: a step's wall time less the host's wait for its tokens;
5. the ES update's wall time for a cohort and the sandbox-free updates/hour it implies;
6. EGGROLL's microbenchmark (``jaxes.es.microbenchmark``; alone: ``benchmarks/eggroll.py``).

The platform's hardware-only tests are pytest's (marked ``hardware``): the report names the
command (``HARDWARE_TESTS``).

Prints a table, then one JSON line (docs/preflight.md, "Reading the measure report"). Defaults:
on CPU the config's own (tiny) model and 8 steps; on an accelerator the 0.5B shape and 200 steps.
Shapes other than ``tiny`` run in bfloat16, as the Qwen2.5 checkpoints ship.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from jaxes import cli

if __name__ == "__main__":   # a command: JAX starts quietly (cli.start_jax) before an import below loads it
  cli.start_jax(init_backends=False)

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxes import measure_decode, preflight, sizing
from jaxes.es import microbenchmark
from jaxes.models.attention import dispatch as attention_dispatch
from jaxes.train import algorithms, builders, compile_cache, precompile
from jaxes.train.state import Parts

# The hardware-only tests (marked ``hardware``, skipped elsewhere) are pytest's to run, by platform:
# the GPU's compile for the H100 deviceless on the CPU client they were written for, the TPU's
# run on the TPU (the suite's conftest picks the CPU unless JAX_PLATFORMS says otherwise).
HARDWARE_TESTS = {"tpu": "JAX_PLATFORMS=tpu python -m pytest -q -m hardware tests",
                  "gpu": "JAX_PLATFORMS=cpu python -m pytest -q -m hardware tests"}


# -- the measurement --------------------------------------------------------------------------------
def measure(config, model_shape: str, steps: int, log=print) -> dict:
  """Every measurement as one dict (``summary`` picks the JSON line's keys)."""
  devices = jax.devices()
  platform_name = attention_dispatch.platform_name(devices[0].platform)
  kind = devices[0].device_kind
  turn_budget = config.rollout.max_new_tokens
  config = measure_decode.measure_config(config, model_shape, len(devices))
  vocab = builders.vocab_size(config)
  model = builders.build_model(config)
  mesh = builders.build_mesh(config)
  modes = measure_decode.modes(config)
  run_mode = measure_decode.run_mode(config)
  order = [run_mode] + [m for m in modes if m != run_mode]
  jobs = max(int(config.train.compile_jobs), 1)
  log(f"measure: {len(devices)} x {kind}, {model_shape} ({model.config.num_layers} layers, "
      f"hidden {model.config.hidden_size}, vocab {vocab}), {config.rollout.num_slots} slots, "
      f"modes {', '.join(order)}")

  # 1. Every program, cold, as the trainer's start-up compiles them (``precompile.run_programs``
  # over each mode's engine, built and dropped in turn: one KV cache at a time).
  run_algorithm = algorithms.build(modes[run_mode][0], Parts(None, model, [], []), mesh)
  params = builders.initial_params(config, model)
  state = run_algorithm.init(params)

  def lowered() -> dict:
    """Every mode's programs, each once: a program two modes share (the reset, the one-version
    steps of lowrank and two_versions) under the first mode's name."""
    out, seen = {}, set()
    for name, (mode_config, es_mode) in modes.items():
      engine = measure_decode.build_engine(mode_config, model, es_mode, mesh, state.run_key)
      lowerings = (precompile.run_programs(engine, run_algorithm, state)() if name == run_mode
                   else engine.programs())
      del engine
      for program, lowered_program in lowerings.items():
        text = lowered_program.as_text()
        if text not in seen:
          seen.add(text)
          out[f"{name}/{program}"] = lowered_program
    return out

  def compile_pass(label: str):
    programs = lowered()
    with compile_cache.watch() as seen:
      run = precompile.compile_all(programs, jobs, read=sizing.program_bytes)
    for p in run.programs:
      if p.error is not None:
        raise p.error
    hows = [how for _, how in seen.programs]
    log(f"  compiled {len(run.programs)} programs {label}: {run.wall_seconds:.1f} s wall "
        f"({hows.count('read')} read from the persistent cache)")
    return run, hows

  phase_s, clock = {}, [time.perf_counter()]

  def phase(name: str) -> None:   # wall seconds of each part, for sizing a rental
    now = time.perf_counter()
    phase_s[name] = now - clock[0]
    clock[0] = now

  cold, cold_hows = compile_pass("cold")
  compiler_bytes = {p.name: p.result for p in cold.programs}
  phase("compile_cold")

  # 2. The preflight's prediction for the config's own run, on these devices.
  target = preflight.Target("local", devices, sizing.device_memory(devices), platform_name, False)
  # Less the evaluation's programs (eval_drift, eval_mc_probe): nothing here runs them, so the
  # measured peak is the decode's and the update's alone.
  plan = preflight.plan(modes[run_mode][0], target, log=lambda *_: None, jobs=jobs, only=r"^(?!eval_)")
  predicted = int(plan["peak_bytes_per_device"])
  phase("preflight_plan")

  # 3. Each mode's steady decode, the config's own run first.
  strategy = run_algorithm.strategy
  rng = np.random.default_rng(config.seed)
  cohort = measure_decode.cohort(strategy, rng)
  placed = {}
  memory = {}
  decode, roofline, per_mode_bytes = {}, {}, {}
  update_s = []
  # From here each program's first call loads it from the persistent cache, as a restarted run
  # does: those loads are the cached compile time (the cold pass wrote every entry).
  with compile_cache.watch() as at_run_time:
    for name in order:
      mode_config, es_mode = modes[name]
      engine = measure_decode.build_engine(mode_config, model, es_mode, mesh, state.run_key)
      if 0 not in placed:
        placed[0] = jax.device_put(state.params, engine.param_shardings)
      pbv = {0: placed[0]}
      if name == "two_versions":
        if 1 not in placed:
          new_state, _ = strategy.update(state, cohort)
          placed[1] = jax.device_put(new_state.params, engine.param_shardings)
        pbv[1] = placed[1]
        engine.policy.add_step(1, *strategy.cohort(state, cohort))
      versions, members = measure_decode.rows(engine, name)
      if engine.policy.member_slices and name == "two_versions" and engine.shards < 2:
        decode[name] = None
        log(f"  {name}: needs 2 data shards under member slices; not measured")
        continue

      def after_step(name=name):   # the run's programs, each after its first call (and later ones)
        if name == run_mode:
          memory["steps"] = max(memory.get("steps", (0, "")), sizing.peak_bytes_in_use(devices))
      decode[name] = measure_decode.decode(engine, mode_config, pbv, versions, members, steps, rng, vocab,
                                            after_step)
      weights = sizing.bytes_per_device(placed[0])
      kv = sizing.bytes_per_device(engine.cache) * decode[name]["kv_in_use_fraction"]
      per_mode_bytes[name] = decode[name]["loop_steps"] / decode[name]["steps"] * (weights + kv)
      decode_names = [p for p in compiler_bytes if p.startswith(f"{name}/step[t={engine.num_slots},")]
      roofline[name] = {"bytes_per_step": per_mode_bytes[name], "weights_bytes": weights, "kv_bytes": kv,
                        "compiler_bytes_per_call": {p.split("/", 1)[1]: compiler_bytes[p] for p in decode_names}}
      if name == run_mode:
        # The ES update, as the run calls it (the first call loads its program from the cache).
        for _ in range(4):
          t = time.perf_counter()
          out, _ = strategy.update(state, cohort)
          jax.block_until_ready(out.params)
          update_s.append(time.perf_counter() - t)
        memory["after_update"] = sizing.peak_bytes_in_use(devices)
      log(f"  {name}: {decode[name]['tokens'] / decode[name]['seconds'] / len(devices):.1f} decode "
          f"tokens/s per chip over {decode[name]['steps']} steps")
      del engine
      phase(f"decode_{name}")

  hows = [how for _, how in at_run_time.programs]
  missed = sorted({program for program, how in at_run_time.programs if how != "read"})
  log(f"  first calls: {hows.count('read')} programs read from the persistent cache; compiled: "
      f"{', '.join(missed) or 'none'}")
  compile_s = {"cold": cold.wall_seconds, "cold_cpu_s": cold.cpu_seconds, "programs": len(cold.programs),
               "jobs": jobs, "cold_read_from_cache": cold_hows.count("read"),
               "slowest": max(((p.seconds, p.name) for p in cold.programs), default=(0.0, ""))[1],
               "cached": at_run_time.seconds_by_how("read"), "cached_programs": hows.count("read"),
               # the rest: small programs first run here (eager ops), or a program the cold pass
               # lowered differently from its call (then it compiles again: look at the count)
               "other_compiles_at_run_time": len(hows) - hows.count("read")}

  # 4. The numbers.
  per_chip = {n: (d["tokens"] / d["seconds"] / len(devices) if d else None) for n, d in decode.items()}
  es_over_plain = {n: per_chip[n] / per_chip["plain"] for n in per_chip
                   if n != "plain" and per_chip[n] is not None}
  measured, how = max(memory["steps"], memory["after_update"])
  bandwidth, source = sizing.peak_bandwidth(kind)
  plain = decode["plain"]
  fraction = (None if bandwidth is None else
              per_mode_bytes["plain"] / plain["median_step_s"] / bandwidth)
  update = statistics.median(update_s[1:])
  # An episode decodes at most its turns' budgets, and at most what its cache row holds.
  episode_tokens = min(int(turn_budget) * int(config.env.max_turns),
                       int(config.rollout.max_len) - measure_decode.PROMPT_TOKENS)
  cohort_tokens = strategy.population * int(config.controller.episodes_per_member) * episode_tokens
  cohort_decode_s = cohort_tokens / (per_chip["lowrank"] * len(devices))
  egg_shape = microbenchmark.eggroll_shape(platform_name)
  log(f"  EGGROLL's microbenchmark at {egg_shape} ...")
  egg = microbenchmark.eggroll(egg_shape, jnp.dtype(model.config.dtype))
  phase("eggroll")
  egg["end_to_end_lowrank_over_plain"] = es_over_plain.get("lowrank")
  tests = {"platform": platform_name, "status": "none for this platform"}
  if platform_name in HARDWARE_TESTS:
    tests = {"platform": platform_name, "status": "not run by measure", "command": HARDWARE_TESTS[platform_name]}
  return {
    "device_kind": kind, "platform": platform_name, "num_devices": len(devices),
    "model_shape": model_shape, "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
    "dtype": model.config.dtype, "num_slots": int(config.rollout.num_slots),
    "population": int(strategy.population), "mesh": dict(mesh.shape), "run_mode": run_mode,
    "steps": steps, "decode": decode, "decode_tokens_per_s": per_chip, "es_over_plain": es_over_plain,
    "peak_bytes_measured": int(measured), "peak_measured_by": how,
    "peak_bytes_predicted": predicted, "memory_measured_over_predicted": measured / predicted,
    "predicted_per_device": plan["per_device"], "device_memory_bytes": int(target.device_memory),
    "roofline_fraction": fraction,
    "roofline": {"peak_bytes_per_s": bandwidth, "source": source, "modes": roofline,
                 **({} if bandwidth is not None else {"reason": source})},
    "host_gap_s": {n: d["host_gap_s"] for n, d in decode.items() if d},
    "calls_per_step": {n: d["calls"] / d["steps"] for n, d in decode.items() if d},
    "update_s": update, "cohort_decode_s": cohort_decode_s,
    "updates_per_hour_sandbox_free": 3600.0 / (update + cohort_decode_s),
    "compile_s": compile_s, "phase_s": phase_s, "eggroll": egg, "hardware_tests": tests,
    "machine": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
    "jax": jax.__version__, "jaxlib": jaxlib.__version__, "date": datetime.date.today().isoformat(),
  }


SUMMARY_KEYS = ("device_kind", "num_devices", "decode_tokens_per_s", "es_over_plain",
                "peak_bytes_measured", "peak_bytes_predicted", "memory_measured_over_predicted",
                "roofline_fraction", "roofline", "host_gap_s", "calls_per_step", "update_s",
                "updates_per_hour_sandbox_free", "compile_s", "phase_s", "eggroll", "hardware_tests",
                "model_shape", "steps", "num_slots", "machine", "jax", "jaxlib", "date")


def summary(report: dict) -> dict:
  """The JSON line: the report's headline keys (``SUMMARY_KEYS``), the roofline without its
  per-program detail."""
  out = {k: report[k] for k in SUMMARY_KEYS}
  out["roofline"] = {k: v for k, v in report["roofline"].items() if k != "modes"}
  return out


def _fmt_rate(x) -> str:
  return "-" if x is None else f"{x:,.1f}"


def render(report: dict) -> list[str]:
  r = report
  gib = lambda n: f"{n / 2**30:.3f} GiB"
  lines = [f"measure on {r['num_devices']} x {r['device_kind']} ({r['platform']}), shape {r['model_shape']} "
           f"({r['parameters'] / 1e6:.1f}M parameters, {r['dtype']}), {r['num_slots']} slots, "
           f"population {r['population']}, {r['steps']} decode steps per mode, {r['date']}",
           f"  {'mode':14s} {'tok/s/chip':>12s} {'/ plain':>8s} {'step ms':>9s} {'host gap ms':>12s} "
           f"{'roofline':>9s}"]
  bandwidth = r["roofline"]["peak_bytes_per_s"]
  for name, d in r["decode"].items():
    if d is None:
      lines.append(f"  {name:14s} not measured")
      continue
    ratio = r["es_over_plain"].get(name)
    roof = r["roofline"]["modes"][name]["bytes_per_step"] / d["median_step_s"]
    lines.append(f"  {name:14s} {_fmt_rate(r['decode_tokens_per_s'][name]):>12s} "
                 f"{'' if ratio is None else f'{ratio:.3f}':>8s} {1e3 * d['median_step_s']:9.2f} "
                 f"{1e3 * d['host_gap_s']:12.2f} {'-' if bandwidth is None else f'{roof / bandwidth:.1%}':>9s}")
  lines.append(f"  roofline: {r['roofline']['source']}" + ("" if bandwidth is None else
               f", {bandwidth / 1e12:.2f} TB/s peak"))
  lines.append(f"  memory per device: measured {gib(r['peak_bytes_measured'])} ({r['peak_measured_by']}), "
               f"predicted {gib(r['peak_bytes_predicted'])}, measured / predicted "
               f"{r['memory_measured_over_predicted']:.2f}")
  c = r["compile_s"]
  lines.append(f"  compile: {c['programs']} programs cold in {c['cold']:.1f} s ({c['jobs']} jobs); at their "
               f"first calls {c['cached_programs']} read from the persistent cache in {c['cached']:.1f} s, "
               f"{c['other_compiles_at_run_time']} other compiles")
  lines.append(f"  ES update: {r['update_s'] * 1e3:.1f} ms for {r['population']} members; sandbox-free "
               f"{r['updates_per_hour_sandbox_free']:,.0f} updates/hour (cohort decode {r['cohort_decode_s']:.1f} s)")
  e = r["eggroll"]
  lines.append(f"  EGGROLL microbenchmark {e['shape']} {e['dtype']}: ES / plain {e['es_over_plain']:.3f} "
               f"(reported {e['reported']:.2f}); end to end here: low-rank / plain "
               f"{e['end_to_end_lowrank_over_plain']:.3f}")
  t = r["hardware_tests"]
  lines.append(f"  hardware tests ({t['platform']}): {t['status']}"
               + (f": {t['command']}" if "command" in t else ""))
  return lines


def main(argv):
  from absl import flags
  FLAGS = flags.FLAGS
  if len(argv) > 1:
    cli.usage_error("measure", f"unexpected arguments {argv[1:]}")
  accelerator = attention_dispatch.platform_name(jax.devices()[0].platform) != "cpu"
  shape = FLAGS.model_shape or ("0.5B" if accelerator else "tiny")
  if shape not in measure_decode.SHAPES:
    print(f"measure: --model_shape={shape!r} is not one of {', '.join(measure_decode.SHAPES)}", file=sys.stderr)
    sys.exit(2)
  steps = FLAGS.steps or (200 if accelerator else 8)
  if steps < 1:
    print(f"measure: --steps must be at least 1, got {steps}", file=sys.stderr)
    sys.exit(2)
  from jaxes.train.config import ConfigError
  log = (lambda *_: None) if FLAGS.json else (lambda m: print(m, file=sys.stderr, flush=True))
  with tempfile.TemporaryDirectory() as workdir:
    compile_cache.enable(workdir)   # JAX_COMPILATION_CACHE_DIR wins; else a fresh one: cold is cold
    try:
      report = measure(FLAGS.config, shape, steps, log=log)
    except ConfigError as e:
      print(f"invalid config: {e}", file=sys.stderr)
      sys.exit(2)
  if not FLAGS.json:
    print("\n".join(render(report)))
  print(json.dumps(summary(report)))


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "An ml-collections config file (configs/*.py[:ARG]).")
  flags.DEFINE_string("model_shape", None, f"Qwen2.5 shape: {', '.join(measure_decode.SHAPES)} (tiny: the config's "
                      "own model); default 0.5B on an accelerator, tiny on CPU.")
  flags.DEFINE_integer("steps", None, "Decode-only engine steps per mode (default 200 on an "
                       "accelerator, 8 on CPU).")
  flags.DEFINE_bool("json", False, "Print only the JSON line.")
  flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main)

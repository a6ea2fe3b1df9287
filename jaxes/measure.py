"""Measure a config's real programs on the devices at hand, beside the preflight's predictions.

  python -m jaxes.measure --config=configs/demo.py [--model_shape=tiny|0.5B|1.5B|7B] [--steps=N]
      [--json] [--hardware_tests=False] [--config.rollout.num_slots=...]

On the devices JAX sees (GPU, TPU or CPU) it builds the config's run at a Qwen2.5 shape with random
weights (``model.path`` set: that checkpoint) through the trainer's builders
(``jaxes.train.builders``, ``jaxes.train.algorithms``), and:

1. compiles every program of four decode modes and the ES update with the trainer's start-up
   compile (``precompile.compile_all`` in ``train.compile_jobs`` threads) into the persistent
   cache, cold; each program's first call then loads it from that cache, as a restarted run
   does, and those loads are timed (``compile_s``: ``cold``, ``cached``);
2. runs the engine's steady decode for ``--steps`` engine steps per mode, one mode after another:
   ``plain`` (no noiser: what σ = 0 costs, plain inference), ``lowrank`` (every slot its own
   member, at least 64 slots live), ``fullrank`` (member slices; only where the config's
   ``es.mode`` is "full") and ``two_versions`` (half the rows a version newer, as an async run
   decodes them: one call with version steps where the update is a low-rank step). Decode tokens/s
   per chip counts the decode-only steps (a step that prefilled or compiled is left out, counted);
   rows that end their turn start again;
3. memory: each device's ``memory_stats()`` peak after each program's first call of the config's
   own run (the first mode run), next to ``jaxes.preflight.plan`` of the same config on the same
   devices, and their ratio. The CPU backend keeps no memory statistics: there the measured
   number is the largest sum of live arrays on one device (``jax.live_arrays``; temporaries unseen);
4. roofline: bytes a decode step must move per device (its weights + the live KV, once per token
   of the device loop) over the measured step time, against the chip's peak HBM bandwidth
   (``PEAK_HBM``); beside it the compiler's own estimate (cost analysis "bytes accessed") of the
   decode program. Host gap: a decode step's wall time less the time the host waited for the
   device's sampled tokens (``EngineStats.device_wait_s``): block timing, no profiler;
5. the ES update's wall time for a population's cohort and the sandbox-free updates/hour
   it implies (decoding every episode's turns at the low-rank rate, plus the update);
6. EGGROLL's microbenchmark (``eggroll``): one linear layer, a distinct low-rank member per row,
   no update, through ``jaxes.es`` noiser vs the plain matmul;
7. the hardware-only tests of the platform (``HARDWARE_TESTS``), pass/fail.

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
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

from jaxes import cli

if __name__ == "__main__":   # a command: JAX starts quietly (cli.start_jax) before an import below loads it
  cli.start_jax(init_backends=False)

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxes import preflight
from jaxes.models import qwen2
from jaxes.models.attention import dispatch as attention_dispatch
from jaxes.train import algorithms, builders, compile_cache, precompile
from jaxes.train.algorithms import evolution
from jaxes.train.state import Parts

SHAPES = {"tiny": None, "0.5B": "qwen2.5-0.5b", "1.5B": "qwen2.5-1.5b", "7B": "qwen2.5-7b"}
MIN_LIVE_MEMBERS = 64     # ES low-rank mode decodes at least this many distinct members at once
PROMPT_TOKENS = 16        # each row's prompt; then it decodes to the end of its cache row

# Peak HBM bandwidth per chip, bytes/s, by the start of ``device_kind`` as JAX reports it (first
# match wins; more specific names first). Sources:
# * NVIDIA H100 SXM5 80GB: 3.35 TB/s, NVIDIA H100 Tensor Core GPU datasheet (the figure XLA's
#   own h100_sxm.txtpb spec carries, jaxes.gpu_targets); H100 PCIe 2.0 TB/s, same datasheet.
# * NVIDIA H200 141GB: 4.8 TB/s, NVIDIA H200 Tensor Core GPU datasheet.
# * NVIDIA A100 SXM4 80GB: 2,039 GB/s; A100 40GB: 1,555 GB/s; NVIDIA A100 datasheet.
# * TPU v4: 1,200 GBps; v5e: 819 GBps; v5p: 2,765 GBps; v6e (Trillium): 1,638 GBps; Google Cloud
#   TPU system-architecture pages, docs.cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}.
PEAK_HBM = (
  ("NVIDIA H100 PCIe", 2.0e12, "NVIDIA H100 datasheet (PCIe)"),
  ("NVIDIA H100", 3.35e12, "NVIDIA H100 datasheet (SXM5)"),
  ("NVIDIA H200", 4.8e12, "NVIDIA H200 datasheet"),
  ("NVIDIA A100-SXM4-40GB", 1.555e12, "NVIDIA A100 datasheet (40GB)"),
  ("NVIDIA A100-SXM4-80GB", 2.039e12, "NVIDIA A100 datasheet (SXM4 80GB)"),
  ("TPU v4", 1.2e12, "Cloud TPU v4 system architecture"),
  ("TPU v5 lite", 8.19e11, "Cloud TPU v5e system architecture"),
  ("TPU v5e", 8.19e11, "Cloud TPU v5e system architecture"),
  ("TPU v5p", 2.765e12, "Cloud TPU v5p system architecture"),
  ("TPU v5", 2.765e12, "Cloud TPU v5p system architecture"),
  ("TPU v6 lite", 1.638e12, "Cloud TPU v6e system architecture"),
  ("TPU v6e", 1.638e12, "Cloud TPU v6e system architecture"),
)

# The hardware-only tests per platform (pytest arguments from the repository root), the ones
# that skip on CPU. One place to change when the suite gets a marker per component (then:
# ("-m", "tpu")).
HARDWARE_TESTS = {
  "tpu": ("tests/models/test_kernels_tpu.py::test_on_a_tpu_the_kernel_matches_the_portable_path",),
  "gpu": ("tests/models/test_kernels_tpu.py::test_a_gpu_target_is_the_gpu_platform_and_its_lowering_asks_cudnn",
          "tests/test_preflight_gpu.py::test_cudnn_attention_compiles_deviceless_for_an_h100"),
}
HARDWARE_TESTS_TIMEOUT_S = 300

# EGGROLL's throughput microbenchmark, by its maintainers' account (HyperscaleES issue #4, as
# ../shared/ANCHORS.md records it): one linear layer, input 1024 x 8192, batch = population, a
# different member per row, no update. Read here as 1024 rows (members) of 8192 features into a
# square 8192 x 8192 layer (the output width is not stated). On CPU a scaled-down layer.
EGGROLL_SHAPE = (1024, 8192, 8192)     # (rows = members, in, out)
EGGROLL_CPU_SHAPE = (64, 512, 512)
EGGROLL_REPORTED = 0.91                # "91% of pure batch-inference throughput"


def peak_bandwidth(device_kind: str) -> tuple[float | None, str]:
  """(peak HBM bytes/s, its source) for a device kind, or (None, why there is none)."""
  for prefix, bandwidth, source in PEAK_HBM:
    if device_kind.startswith(prefix):
      return bandwidth, source
  if device_kind.lower() == "cpu":
    return None, "CPU: no HBM peak"
  return None, f"no known HBM peak for {device_kind!r} (add it to jaxes.measure.PEAK_HBM)"


def program_bytes(compiled) -> float | None:
  """The compiler's cost analysis of a compiled program: bytes it accesses (per device), or None
  where the backend gives none (the GPU compiler without a GPU, jaxes.gpu_targets, has no cost
  analysis; a GPU with one has). Loops count their body once."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 -- "UNIMPLEMENTED" on compile-only clients: no number, not an error
    return None
  if isinstance(analysis, (list, tuple)):   # older JAX: one dict per computation
    analysis = analysis[0] if analysis else None
  if not analysis or "bytes accessed" not in analysis:
    return None
  return float(analysis["bytes accessed"])


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


def vocab_size(config) -> int:
  preset = qwen2.PRESETS.get(config.model.preset, {})
  return int(config.model.vocab_size or preset.get("vocab_size") or config.tokenizer.vocab_size)


def _modes(config) -> dict:
  """Mode name -> (its config, ES or not). ``two_versions`` is an async run one version behind."""
  def variant(mode=None, controller="sync"):
    c = config.copy_and_resolve_references()
    if mode:
      c.es.mode = mode
    c.controller.mode = controller
    c.controller.max_staleness = max(1, int(c.controller.max_staleness)) if controller == "async" else 0
    return c
  modes = {"plain": (variant(), False), "lowrank": (variant("lowrank"), True)}
  if config.es.mode == "full":
    modes["fullrank"] = (variant("full"), True)
  modes["two_versions"] = (variant(controller="async"), True)
  return modes


def _run_mode(config) -> str:
  """The mode that is the config's own run (its memory is the one the preflight predicts)."""
  if config.controller.mode == "async" and int(config.controller.max_staleness) >= 1:
    return "two_versions"
  return "fullrank" if config.es.mode == "full" else "lowrank"


def _engine(config, model, es_mode: bool, mesh, abstract: bool, run_key=None):
  key = jax.random.key(config.seed) if run_key is None else run_key
  policy = (evolution.es_policy_bank(config, model, evolution.build_strategy(config), key)
            if es_mode else None)
  # No tokenizer, as the preflight builds its engines (the same programs: the stop ids are part of
  # them): token 0 ends a turn, which random weights rarely sample; such a row starts again.
  return builders.build_engine(config, model, None, policy, mesh=mesh, abstract=abstract)


# -- memory -----------------------------------------------------------------------------------------
def _device_peak(devices) -> tuple[int, str]:
  """(bytes, how): the largest ``peak_bytes_in_use`` of the devices, or on a backend without
  memory statistics (CPU) the largest sum of live arrays' shards on one device."""
  stats = [d.memory_stats() for d in devices]
  if all(s and "peak_bytes_in_use" in s for s in stats):
    return max(int(s["peak_bytes_in_use"]) for s in stats), "memory_stats peak_bytes_in_use"
  per_device = {d: 0 for d in devices}
  for array in jax.live_arrays():
    for shard in array.addressable_shards:
      if shard.device in per_device:
        per_device[shard.device] += shard.data.nbytes
  return max(per_device.values()), "live arrays (no memory_stats on this backend: temporaries unseen)"


def _device_memory(devices) -> float:
  stats = devices[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return float(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(devices)


def _bytes_per_device(tree) -> int:
  """The most bytes one device holds of a pytree of placed arrays."""
  per_device: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values()) if per_device else 0


# -- steady decode ----------------------------------------------------------------------------------
def _start_row(engine, config, i: int, version: int, member: int, rng, vocab: int) -> None:
  prompt = [int(t) for t in rng.integers(1, vocab, size=PROMPT_TOKENS)]
  if not engine.scheduler.start(i, prompt, version=version, member=member, stream=i,
                      temperature=float(config.rollout.temperature), top_p=float(config.rollout.top_p)):
    raise RuntimeError(f"measure: slot {i} refused a {PROMPT_TOKENS}-token prompt")


def _decode(engine, config, params_by_version: dict, versions, members, steps: int, rng, vocab,
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


def _rows(engine, mode: str) -> tuple[list[int], list[int]]:
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


def _cohort(strategy, rng) -> list[tuple[int, int, float]]:
  return [(0, m, float(rng.normal())) for m in range(strategy.population)]


# -- EGGROLL's microbenchmark -----------------------------------------------------------------------
def eggroll(shape: tuple[int, int, int], dtype, repeats: int = 20) -> dict:
  """Plain ``x @ w`` vs the same layer through ``jaxes.es``'s noiser with a distinct low-rank
  (rank 1) member per row, no update: the noiser built once (as the engine reuses it over decode
  steps), the matmul timed; throughput relative to the plain layer."""
  from jaxes import es
  rows, n_in, n_out = shape
  key_w, key_x = jax.random.split(jax.random.key(0))
  params = {"w": jax.random.normal(key_w, (n_in, n_out), jnp.float32).astype(dtype)}
  x = jax.random.normal(key_x, (rows, n_in), jnp.float32).astype(dtype)
  strategy = es.Strategy(population=rows, sigma=1e-3, learning_rate=1e-3, mode="lowrank", rank=1)
  members = jnp.arange(rows, dtype=jnp.int32)
  noiser = jax.jit(lambda p: strategy.member_noiser(
      p, jnp.zeros(rows, jnp.int32), members, members, run_key=jax.random.key(1)))(params)
  plain = jax.jit(lambda x, w: x @ w)
  perturbed = jax.jit(lambda x, w, noiser: noiser.dense(x, w, None, name="w"))

  def best(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t)
    return min(times)

  plain_s = best(plain, x, params["w"])
  es_s = best(perturbed, x, params["w"], noiser)
  return {"shape": list(shape), "dtype": jnp.dtype(dtype).name, "plain_s": plain_s, "es_s": es_s,
          "es_over_plain": plain_s / es_s, "reported": EGGROLL_REPORTED}


# -- hardware tests ---------------------------------------------------------------------------------
def hardware_tests(platform_name: str, root: str) -> dict:
  """Runs ``HARDWARE_TESTS[platform]`` in a pytest subprocess on this platform's devices."""
  selection = HARDWARE_TESTS.get(platform_name)
  if not selection:
    return {"platform": platform_name, "status": "none for this platform"}
  with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "junit.xml")
    # The GPU's cuDNN tests compile for the H100 deviceless (jaxes.gpu_targets), on the CPU client
    # they were written for; the TPU's run on the TPU.
    env = {**os.environ, "JAX_PLATFORMS": "tpu" if platform_name == "tpu" else "cpu"}
    try:
      out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"--junitxml={report}", *selection], cwd=root, env=env,
                           capture_output=True, text=True, timeout=HARDWARE_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      return {"platform": platform_name, "status": "timed out", "selection": list(selection)}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if os.path.exists(report):
      for case in ElementTree.parse(report).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts["failed" if kind in ("failure", "error") else kind] += 1
  status = ("failed" if out.returncode not in (0, 5) or counts["failed"] else
            "passed" if counts["passed"] else "skipped")
  return {"platform": platform_name, "status": status, **counts, "selection": list(selection),
          "tail": out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []}


# -- the measurement --------------------------------------------------------------------------------
def platform_before_init() -> str:
  """The platform JAX will pick ("cpu", "gpu", "tpu"), found without initialising a backend in
  this process: a TPU is held by one process at a time, and the hardware tests run in another
  before this one takes the devices."""
  wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip()
  if wanted in ("cpu", "tpu"):
    return wanted
  probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
                         capture_output=True, text=True, timeout=300)
  name = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "cpu"
  return attention_dispatch.platform_name(name)


def measure(config, model_shape: str, steps: int, log=print, hardware: dict | None = None) -> dict:
  """Every measurement as one dict (``summary`` picks the JSON line's keys); ``hardware``: the
  hardware tests' result, run before (``hardware_tests``)."""
  devices = jax.devices()
  platform_name = attention_dispatch.platform_name(devices[0].platform)
  kind = devices[0].device_kind
  turn_budget = config.rollout.max_new_tokens
  config = measure_config(config, model_shape, len(devices))
  vocab = vocab_size(config)
  model = builders.build_model(config, vocab)
  mesh = builders.build_mesh(config)
  modes = _modes(config)
  run_mode = _run_mode(config)
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
      engine = _engine(mode_config, model, es_mode, mesh, abstract=False, run_key=state.run_key)
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
      run = precompile.compile_all(programs, jobs, read=program_bytes)
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
  target = preflight.Target("local", devices, _device_memory(devices), platform_name, False)
  # Less the evaluation's programs (eval_drift, eval_mc_probe): nothing here runs them, so the
  # measured peak is the decode's and the update's alone.
  plan = preflight.plan(modes[run_mode][0], target, log=lambda *_: None, jobs=jobs, only=r"^(?!eval_)")
  predicted = int(plan["peak_bytes_per_device"])
  phase("preflight_plan")

  # 3. Each mode's steady decode, the config's own run first.
  strategy = run_algorithm.strategy
  rng = np.random.default_rng(config.seed)
  cohort = _cohort(strategy, rng)
  placed = {}
  memory = {}
  decode, roofline, per_mode_bytes = {}, {}, {}
  update_s = []
  # From here each program's first call loads it from the persistent cache, as a restarted run
  # does: those loads are the cached compile time (the cold pass wrote every entry).
  with compile_cache.watch() as at_run_time:
    for name in order:
      mode_config, es_mode = modes[name]
      engine = _engine(mode_config, model, es_mode, mesh, abstract=False, run_key=state.run_key)
      if 0 not in placed:
        placed[0] = jax.device_put(state.params, engine.param_shardings)
      pbv = {0: placed[0]}
      if name == "two_versions":
        if 1 not in placed:
          new_state, _ = strategy.update(state, cohort)
          placed[1] = jax.device_put(new_state.params, engine.param_shardings)
        pbv[1] = placed[1]
        engine.policy.add_step(1, *strategy.cohort(state, cohort))
      versions, members = _rows(engine, name)
      if engine.policy.member_slices and name == "two_versions" and engine.shards < 2:
        decode[name] = None
        log(f"  {name}: needs 2 data shards under member slices; not measured")
        continue

      def after_step(name=name):   # the run's programs, each after its first call (and later ones)
        if name == run_mode:
          memory["steps"] = max(memory.get("steps", (0, "")), _device_peak(devices))
      decode[name] = _decode(engine, mode_config, pbv, versions, members, steps, rng, vocab, after_step)
      weights = _bytes_per_device(placed[0])
      kv = _bytes_per_device(engine.cache) * decode[name]["kv_in_use_fraction"]
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
        memory["after_update"] = _device_peak(devices)
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
  bandwidth, source = peak_bandwidth(kind)
  plain = decode["plain"]
  fraction = (None if bandwidth is None else
              per_mode_bytes["plain"] / plain["median_step_s"] / bandwidth)
  update = statistics.median(update_s[1:])
  # An episode decodes at most its turns' budgets, and at most what its cache row holds.
  episode_tokens = min(int(turn_budget) * int(config.env.max_turns), int(config.rollout.max_len) - PROMPT_TOKENS)
  cohort_tokens = strategy.population * int(config.controller.episodes_per_member) * episode_tokens
  cohort_decode_s = cohort_tokens / (per_chip["lowrank"] * len(devices))
  egg_shape = EGGROLL_CPU_SHAPE if platform_name == "cpu" else EGGROLL_SHAPE
  log(f"  EGGROLL's microbenchmark at {egg_shape} ...")
  egg = eggroll(egg_shape, jnp.dtype(model.config.dtype))
  phase("eggroll")
  egg["end_to_end_lowrank_over_plain"] = es_over_plain.get("lowrank")
  tests = hardware or {"platform": platform_name, "status": "not run (--hardware_tests=False)"}
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
  lines.append(f"  hardware tests ({t['platform']}): {t['status']}")
  return lines


def main(argv):
  from absl import flags
  FLAGS = flags.FLAGS
  if len(argv) > 1:
    cli.usage_error("measure", f"unexpected arguments {argv[1:]}")
  platform_name = platform_before_init()
  accelerator = platform_name != "cpu"
  shape = FLAGS.model_shape or ("0.5B" if accelerator else "tiny")
  if shape not in SHAPES:
    print(f"measure: --model_shape={shape!r} is not one of {', '.join(SHAPES)}", file=sys.stderr)
    sys.exit(2)
  steps = FLAGS.steps or (200 if accelerator else 8)
  if steps < 1:
    print(f"measure: --steps must be at least 1, got {steps}", file=sys.stderr)
    sys.exit(2)
  from jaxes.train.config import ConfigError
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tests = hardware_tests(platform_name, root) if FLAGS.hardware_tests else None
  log = (lambda *_: None) if FLAGS.json else (lambda m: print(m, file=sys.stderr, flush=True))
  with tempfile.TemporaryDirectory() as workdir:
    compile_cache.enable(workdir)   # JAX_COMPILATION_CACHE_DIR wins; else a fresh one: cold is cold
    try:
      report = measure(FLAGS.config, shape, steps, log=log, hardware=tests)
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
  flags.DEFINE_string("model_shape", None, f"Qwen2.5 shape: {', '.join(SHAPES)} (tiny: the config's "
                      "own model); default 0.5B on an accelerator, tiny on CPU.")
  flags.DEFINE_integer("steps", None, "Decode-only engine steps per mode (default 200 on an "
                       "accelerator, 8 on CPU).")
  flags.DEFINE_bool("hardware_tests", True, "Run the platform's hardware-only tests.")
  flags.DEFINE_bool("json", False, "Print only the JSON line.")
  flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main)

"""Does a training config fit its target devices? Proven by compiling the run, not by renting it.

  python -m jaxes.preflight --config=configs/paper.py:async1 --topology=8xH100 [--json] [--jobs=N]
      [--config.rollout.num_slots=...] [--headroom=0.9] [--device_memory_gib=...] [--only=REGEX]

Builds the run abstractly (shapes and shardings only: nothing is allocated) on a mesh over the
topology's devices, ahead-of-time compiles every program the run executes — each engine step
(width x attention span), the cache reset, the noiser build, the ES update; held-out evaluation
runs the same step programs with member -1 — and prints per device: parameters, the KV cache,
noiser state, the low-rank steps between live versions (an async low-rank SGD run decodes the
rows of all its versions in one call), optimizer state, the older parameter versions kept alive
for in-flight episodes, and each program's compiled temporaries, against the device's memory.
The peak is the resident state plus the largest program's temporaries and non-donated outputs. Exit 0 iff the peak is
at most ``headroom`` of the device memory and no compiler logged that it could not rematerialise a
program below the device's memory (the GPU compiler compiles such a program anyway), else 1 with
a line naming the biggest consumer (or the program) and what to change. The report gives each
program's compile seconds and in total the programs, compile CPU-seconds and the wall time at
``--jobs`` parallel compiles. The last line is one JSON object.

A config whose ``mesh.target`` names other devices than ``--topology`` is refused in one line
naming both (its mesh is sized for those): pick the config's variant for the topology.

Topologies:
* TPU slices (``v4-8``, ``v5e-8``, ``v5p-8`` ... ``v5p-128``, ``v6e-8``): the real TPU compiler
  through ``jax.experimental.topologies`` (needs ``libtpu``: ``pip install -e '.[tpu]'``; no TPU
  needed).
* GPU targets (``8xH100``, ``8xH200``, ``NxH100``/``NxH200`` for N a multiple of 8): the real XLA
  GPU compiler, deviceless (``jaxes.gpu_targets``; needs the CUDA plugin: ``pip install -e
  '.[gpu-aot]'``; no GPU needed). Without it, one line says so and the numbers are an
  *estimate* from the CPU compiler compiling the same mesh over host devices, labelled as such:
  the CPU backend widens some bfloat16 arithmetic to float32, so its temporaries can exceed the
  GPU compiler's (0.46x to 0.77x of them measured, issue 32: no fixed factor).
* ``cpu:N``: N host devices (the structure, on any machine); memory = host RAM / N unless
  ``--device_memory_gib`` says otherwise.

Device memory is the vendor's nominal per-chip HBM in decimal GB (conservative: the usable
amount is a little larger). On GPU, JAX preallocates 75% of memory by default: run with
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` for the headroom checked here to be available.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import tempfile

from jaxes import cli, gpu_targets  # noqa: E402 -- import no JAX: safe before the flags below


# Host devices must be configured before JAX initialises: `cpu:N` and the GPU estimates compile
# over N fake host devices. Only when run as a program (a test process has its own devices).
def _host_devices_wanted(argv) -> int | None:
  for arg in argv:
    m = re.fullmatch(r"--topology=(.+)", arg)
    if m:
      name = m.group(1)
      if parsed := gpu_targets.parse(name):
        return parsed[1]
      if re.fullmatch(r"cpu:\d+", name):
        return int(name.split(":")[1])
  return None


if __name__ == "__main__":
  _n = _host_devices_wanted(sys.argv) or 8  # no --topology: the config's target, up to 8 GPUs
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # TPU topologies compile from the CPU client too
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: no TPU to share
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_n}").strip()
  cli.start_jax(init_backends=False)   # without the CUDA plugin's import-time lines

import jax  # noqa: E402

from jaxes import sharding, sizing  # noqa: E402
from jaxes.train import precompile  # noqa: E402

# Google Cloud's TPU system-architecture pages: per-chip HBM (decimal GB) and the topology of
# each slice name (vN-C: C TensorCores; v5p and v4 chips are one megacore device of 2 cores).
TPU_MEMORY = {"v4": 32e9, "v5e": 16e9, "v5p": 95e9, "v6e": 32e9}
TPU_TOPOLOGIES = {
  "v4-8": "v4:2x2x1", "v4-16": "v4:2x2x2", "v4-32": "v4:2x2x4",
  "v5e-1": "v5e:1x1", "v5e-4": "v5e:2x2", "v5e-8": "v5e:2x4", "v5e-16": "v5e:4x4",
  "v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4",
  "v5p-128": "v5p:4x4x4",
  "v6e-1": "v6e:1x1", "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4",
}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  devices: list
  device_memory: float   # bytes per device
  compiler: str          # "tpu", "gpu" (deviceless, gpu_targets), or "cpu" (cpu:N, GPU estimates)
  estimate: bool         # GPU by the CPU compiler
  attention: str | None = None   # GPU compiler: "cuDNN", or blockwise where cuDNN is not installed


def resolve_topology(name: str, device_memory_gib: float | None = None,
                     cpu_estimate: bool = False) -> Target:
  """Devices (real or abstract), memory per device and compiler for a topology name;
  ``cpu_estimate``: a GPU target by the CPU compiler even where the GPU compiler is installed
  (to compare the two)."""
  override = None if device_memory_gib is None else device_memory_gib * 2**30
  if name in TPU_TOPOLOGIES:
    try:
      from jax.experimental import topologies
      topo = topologies.get_topology_desc(TPU_TOPOLOGIES[name], "tpu")
    except Exception as e:  # libtpu missing or unable to describe the slice
      cli.usage_error("preflight", f"cannot describe TPU topology {name!r} ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}); install libtpu: pip install -e '.[tpu]'")
    memory = override or TPU_MEMORY[name.split("-")[0]]
    return Target(name, list(topo.devices), memory, "tpu", False)
  if parsed := gpu_targets.parse(name):
    chip, n = parsed
    # The compiler rematerialises against the memory it is told: an override reaches it too.
    gpu = None if cpu_estimate else gpu_targets.devices(name, memory=None if override is None else int(override))
    if gpu is not None:
      if gpu_targets.cudnn_installed():
        return Target(name, gpu, override or chip.nominal, "gpu", False, "cuDNN")
      # The engine would trace cuDNN attention, fail and compile blockwise: say so, not silently.
      print(f"preflight: cuDNN is not installed, so attention is compiled blockwise, not as a GPU "
            f"run with cuDNN runs it; for cuDNN: {gpu_targets.CUDNN_HINT}", file=sys.stderr)
      return Target(name, gpu, override or chip.nominal, "gpu", False,
                    "blockwise (cuDNN not installed)")
    if not cpu_estimate:
      print(f"preflight: {name} sized by the CPU compiler (an estimate); for the real GPU compiler: "
            f"pip install -e '.[gpu-aot]'", file=sys.stderr)
    return Target(name, _host_devices(name, n), override or chip.nominal, "cpu", True)
  m = re.fullmatch(r"cpu:(\d+)", name)
  if m:
    n = int(m.group(1))
    return Target(name, _host_devices(name, n), override or sizing.host_memory_per_device(n), "cpu", False)
  cli.usage_error("preflight", f"unknown topology {name!r}; known: cpu:N, NxH100, NxH200 "
                  f"(8xH100, 16xH200, ...), {', '.join(TPU_TOPOLOGIES)}")


def _host_devices(name: str, n: int) -> list:
  devices = jax.devices("cpu")
  if len(devices) < n:
    cli.usage_error("preflight", f"{name} needs {n} host devices, this process has {len(devices)} "
                    f"(run it as `python -m jaxes.preflight`, which sets them up)")
  return devices[:n]


# -- the run, abstractly ----------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
  name: str
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int
  replaces: int = 0      # resident bytes this program's output takes the place of
  required: int = 0      # > 0: the compiler refused it, needing this many bytes in all
  seconds: float = 0.0
  remat_failures: list = dataclasses.field(default_factory=list)  # the compiler's "can't reduce
  # memory use below" lines: it compiled the program, over the device's memory

  @property
  def extra(self) -> int:
    """Bytes beyond the resident state while it runs: temporaries and fresh outputs."""
    return self.temporaries + max(0, self.outputs - self.aliased - self.replaces) + self.code


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\)")


def _compile_all(lowered: dict, jobs: int, replaces: dict, log, algorithm: str
                 ) -> tuple[list[Program], precompile.Compilation]:
  """Compile in ``jobs`` threads and read each memory analysis; a compiler that runs out of
  device memory (the TPU compiler refuses such a program) gives the bytes it said it needed."""
  def done(c: precompile.Compiled):
    log(f"  [{algorithm}] compiled {c.name} in {c.seconds:.1f}s" + ("" if c.error else
        f": temporaries {c.result.temp_size_in_bytes / 2**30:.2f} GiB"))

  run = precompile.compile_all(lowered, jobs, read=lambda compiled: compiled.memory_analysis(),
                               on_done=done)
  programs = []
  for c in run.programs:
    if c.error is not None:   # only out-of-memory refusals are reported, others raise
      m = _OOM.search(str(c.error))
      if "RESOURCE_EXHAUSTED" not in str(c.error) or not m:
        raise c.error
      required = float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10)
      programs.append(Program(c.name, 0, 0, 0, 0, 0, replaces.get(c.name, 0), int(required), c.seconds))
      continue
    stats = c.result
    programs.append(Program(c.name, stats.argument_size_in_bytes, stats.output_size_in_bytes,
                            stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                            stats.generated_code_size_in_bytes, replaces.get(c.name, 0), 0,
                            c.seconds, c.remat_failures))
  return programs, run


def live_versions(config) -> int:
  """Parameter versions held at once: the current one and up to ``max_staleness`` older ones
  whose episodes may still be decoding (delayed members hold back results, not parameters)."""
  return 1 + int(config.controller.max_staleness)


ES_COMPARED = ("grpo",)   # algorithms whose report carries the same config sized as ES beside it


def plan(config, target: Target, log=print, only: str | None = None, jobs: int = 1) -> dict:
  """Build the run abstractly on ``target``, compile its programs (those whose name matches the
  regex ``only``, default all) in ``jobs`` threads; the report as a dict. The config's algorithm
  (``train.algorithm``) is sized as it runs; a GRPO config also as ES, on the same model and mesh,
  beside it (``report["es"]``, ``report["es_over_grpo"]``: ES's peak per device over GRPO's; the
  paper's comparison)."""
  report = _plan(config, target, log, only, config.train.algorithm, jobs)
  if config.train.algorithm not in ES_COMPARED:
    return report
  try:
    report["es"] = _plan(config, target, log, only, "es", jobs)
  except NoProgramMatches:   # --only selected GRPO programs alone (e.g. 'grpo_step'): no ES side
    return report
  report["es_over_grpo"] = report["es"]["peak_bytes_per_device"] / report["peak_bytes_per_device"]
  return report


def evaluation_lowerings(config, graphdef, params, mesh) -> dict:
  """The evaluation's own programs where the config runs them: the drift measure (``eval.drift``,
  its KL over ``eval.kl_transcripts`` rows of ``rollout.max_len``) and the multiple-choice probe
  (``eval.mc_probe_file``). Both hold float32 logits over the vocabulary, which can outgrow a
  decode step's temporaries at long rows."""
  from jax.sharding import NamedSharding, PartitionSpec
  from jaxes.train import drift, mc_probe
  if config.eval.num_tasks < 1:   # no evaluation runs
    return {}
  out = {}
  if config.eval.drift:
    replicated = NamedSharding(mesh, PartitionSpec())
    out["eval_drift"] = lambda: drift.lowering(graphdef, params, int(config.eval.kl_transcripts),
                                               int(config.rollout.max_len), replicated)
  if (path := mc_probe.resolve(config.eval.mc_probe_file)) is not None:
    rows, length = mc_probe.rows_bound(mc_probe.load_items(path))
    out["eval_mc_probe"] = lambda: mc_probe.lowering(graphdef, params, rows, length)
  return out


class NoProgramMatches(ValueError):
  """``--only`` selected none of the run's programs."""


def _plan(config, target: Target, log, only: str | None, algorithm: str, jobs: int = 1) -> dict:
  """One algorithm's report: the run built abstractly by the trainer's own builders and the
  algorithm's (``jaxes.train.algorithms``), on a mesh over the target's devices."""
  from jaxes.models import attention
  from jaxes.train import algorithms, builders
  from jaxes.train.state import Parts
  shape = builders.mesh_shape(config, len(target.devices))
  mesh = sharding.make_mesh(*shape, devices=target.devices[:math.prod(shape)])
  model = builders.build_model(config)   # no tokenizer: builders.vocab_size decides
  # No tokenizer and no tasks: the programs depend on neither.
  run = algorithms.ALGORITHMS[algorithm](config, Parts(None, model, [], []), mesh)
  engine = run.build_engine(None, mesh, abstract=True)   # paged: kv_cache counts the pages
  params = engine.abstract_params
  versions = live_versions(config)
  noiser = engine.policy.abstract_noiser
  noiser_bytes = 0 if noiser is None else sizing.bytes_per_device(noiser)
  update_lowerings, update_state = run.abstract_update(params, mesh)
  lowerings = {**engine.lowerings(), **update_lowerings,
               **evaluation_lowerings(config, model.graphdef, params, mesh)}
  # Only the selected programs are lowered (lowering them all cost seconds a plan, issue 38);
  # the error below still names every one.
  matching = {k: lower() for k, lower in lowerings.items() if only is None or re.search(only, k)}
  if not matching:
    raise NoProgramMatches(f"--only={only!r} matches none of the {algorithm} programs: "
                           + ", ".join(sorted(lowerings)))
  programs, compilation = _compile_all(matching, jobs, {"noiser": noiser_bytes}, log, algorithm)

  resident = {
    "parameters": sizing.bytes_per_device(params),
    "old_versions": (versions - 1) * sizing.bytes_per_device(params),
    "kv_cache": sizing.bytes_per_device(engine.cache),
  }
  if engine.policy.abstract_noiser is not None:
    # Rows of all live versions in one call: the merged noiser takes the place of the newer
    # versions' own, and the low-rank steps between versions are held beside it.
    resident |= {"noiser_state": versions * noiser_bytes,
                 "version_steps": sizing.bytes_per_device(engine.policy.abstract_version_steps())}
  resident |= {name: sizing.bytes_per_device(tree) for name, tree in update_state.items()}
  if config.eval.drift:   # jaxes.train.drift: θ_{v-1} kept one update longer for update_cosine,
    # and θ₀ read from the version-0 checkpoint for each evaluation unless an anchor holds it
    resident["drift_params"] = (1 + ("initial_params" not in update_state)) * sizing.bytes_per_device(params)
  total = sum(resident.values())
  peaks = {p.name: max(p.required, total) if p.required else total + p.extra for p in programs}
  worst = max(programs, key=lambda p: peaks[p.name])
  peak = peaks[worst.name]
  per_device = {**resident, "temporaries": peak - total}
  # The engine's attention as the dispatch table picks it for this mesh and cache (the CPU
  # compiler's estimate names none); a GPU compile without cuDNN falls back (target.attention).
  attention_path = target.attention
  if target.compiler == "tpu" or (target.compiler == "gpu" and gpu_targets.cudnn_installed()):
    attention_path = attention.describe(mesh, engine.cache)
  return {
    "topology": target.name, "devices": len(target.devices), "algorithm": algorithm,
    "device_kind": getattr(target.devices[0], "device_kind", "cpu"),
    "compiler": target.compiler, "estimate": target.estimate, "attention": attention_path,
    "mesh": dict(mesh.shape), "device_memory_bytes": int(target.device_memory),
    "peak_bytes_per_device": int(peak), "per_device": per_device,
    "peak_program": worst.name, "live_versions": versions, "only": only,
    "programs": [dataclasses.asdict(p) | {"extra": p.extra} for p in programs],
    "compile": {"jobs": jobs, "wall_seconds": compilation.wall_seconds,
                "cpu_seconds": compilation.cpu_seconds},
    # Programs the compiler could not rematerialise below the device's memory (it compiled them).
    "remat_failures": [[p.name, line] for p in programs for line in p.remat_failures]
                      + [["", line] for line in compilation.unattributed],
  }


ADVICE = {
  "kv_cache": "shard the slots over more devices (mesh.data; KV heads over mesh.tensor where it "
              "divides num_kv_heads) or lower rollout.num_slots x rollout.max_len",
  "parameters": "shard the model over mesh.fsdp / mesh.tensor (fewer devices on mesh.data)",
  "old_versions": "shard the model over mesh.fsdp / mesh.tensor, or lower controller.max_staleness",
  "noiser_state": "use es.mode=lowrank (full-rank noise materialises a member's weights on "
                  "every device) or shard the model over mesh.fsdp / mesh.tensor",
  "version_steps": "lower es.population or controller.max_staleness (each low-rank step between "
                   "live versions holds population x rank x (in + out) floats per matrix)",
  "optimizer_state": "use es.optimizer=sgd (stateless) or shard the model over mesh.fsdp",
  "temporaries": "lower rollout.prefill_chunk (the widest step's activations) or shard more",
  "master_weights": "shard the model over mesh.fsdp / mesh.tensor, or grpo.master_weights=False",
  "reference_params": "grpo.kl_coef=0 and grpo.anchor='none' (no reference policy) or shard the "
                      "model over mesh.fsdp",
  "initial_params": "es.anchor='none' (no θ₀ held for the anchor) or shard the model over "
                    "mesh.fsdp / mesh.tensor",
  "drift_params": "eval.drift=False (no θ₀ read for evaluations, no θ_{v-1} kept for "
                  "update_cosine) or shard the model over mesh.fsdp / mesh.tensor",
  "learner_batch": "lower grpo.tasks_per_update x grpo.group_size or grpo.seq_len",
}
# A GRPO step's temporaries are its activations: say what bounds them.
GRPO_TEMPORARIES = ("raise grpo.micro_batches (fewer episode rows per micro-batch; one row per "
                    "data shard is the least), lower grpo.seq_len, or shard more")


def _gib(n: float) -> str:
  return f"{n / 2**30:8.2f} GiB" if n >= 2**30 or n == 0 else f"{n / 2**20:8.2f} MiB"


def render(report: dict, headroom: float) -> tuple[list[str], bool]:
  """The table (GRPO's, then ES's beside it for a GRPO config) and whether the config's own
  algorithm fits."""
  lines, fits = _render_one(report, headroom)
  if "es" in report:
    verdict = lines.pop()  # about the config's own algorithm: it stays the last line of the table
    es_lines, _ = _render_one(report["es"], headroom)
    lines += ["beside it, the same config as ES (same model, mesh and controller):"] + [
        "  " + line for line in es_lines]
    lines.append(f"ES / GRPO peak per device: {report['es_over_grpo']:.3f} "
                 f"({_gib(report['es']['peak_bytes_per_device']).strip()} vs "
                 f"{_gib(report['peak_bytes_per_device']).strip()})")
    lines.append(verdict)
  return lines, fits


def _render_one(report: dict, headroom: float) -> tuple[list[str], bool]:
  memory = report["device_memory_bytes"]
  peak = report["peak_bytes_per_device"]
  remat = report.get("remat_failures", [])
  fits = peak <= headroom * memory and not remat
  kind = ("estimate: CPU compiler, bf16 widened to f32 on CPU" if report["estimate"] else
          f"real {report['compiler'].upper()} compiler")
  if report.get("attention"):
    kind += f", attention {report['attention']}"
  lines = [f"{report.get('algorithm', 'es').upper()} on {report['topology']}: {report['devices']} x {report['device_kind']} ({kind}), "
           f"mesh {report['mesh']}, {_gib(memory).strip()} per device, "
           f"{report['live_versions']} live parameter version(s)"]
  for key, value in report["per_device"].items():
    note = f"  (largest: {report['peak_program']})" if key == "temporaries" else ""
    lines.append(f"  {key:16s} {_gib(value)}{note}")
  lines.append(f"  {'peak':16s} {_gib(peak)}  = {peak / memory:.1%} of device memory "
               f"(headroom {headroom:.0%})")
  subset = f", only those matching {report['only']!r}" if report.get("only") else ""
  lines.append(f"  programs{subset} (per device: arguments / temporaries / outputs not donated; "
               f"compile seconds):")
  for p in report["programs"]:
    if p["required"]:
      lines.append(f"    {p['name']:24s} refused by the compiler: needs {_gib(p['required'])}")
      continue
    over = "  over the device's memory: could not rematerialise below it" if p.get("remat_failures") else ""
    lines.append(f"    {p['name']:24s} {_gib(p['arguments'])} / {_gib(p['temporaries'])} / "
                 f"{_gib(max(0, p['outputs'] - p['aliased']))}  {p['seconds']:7.1f} s{over}")
  compiled = report.get("compile")
  lines.append(f"  {len(report['programs'])} programs, "
               f"{sum(p['seconds'] for p in report['programs']):.0f} compile seconds" + (
               f" ({compiled['cpu_seconds']:.0f} CPU-seconds, {compiled['wall_seconds']:.0f} s wall "
               f"at {compiled['jobs']} job(s))" if compiled else ""))
  if report.get("only") and not remat and fits:   # what was left out may be the largest program
    lines.append(f"fits, as far as compiled: peak {_gib(peak).strip()} <= {headroom:.0%} of "
                 f"{_gib(memory).strip()} (partial: only the programs matching "
                 f"{report['only']!r}; a full preflight may not fit)")
  elif remat:
    name, line = remat[0]
    lines.append(f"does not fit: the {report['compiler'].upper()} compiler could not rematerialise "
                 f"{name or 'a program'} below the device's memory ({len(remat)} program(s)): "
                 f"{line.split('] ', 1)[-1]}")
  elif fits:
    lines.append(f"fits: peak {_gib(peak).strip()} <= {headroom:.0%} of {_gib(memory).strip()}")
  else:
    biggest = max(report["per_device"], key=report["per_device"].get)
    advice = (GRPO_TEMPORARIES if biggest == "temporaries" and report.get("algorithm") == "grpo"
              else ADVICE[biggest])
    lines.append(f"does not fit: peak {_gib(peak).strip()} > {headroom:.0%} of "
                 f"{_gib(memory).strip()}; biggest consumer {biggest} "
                 f"({_gib(report['per_device'][biggest]).strip()}/device): {advice}")
  return lines, fits


def summary(report: dict, fits: bool, headroom: float = 0.9) -> dict:
  out = {"topology": report["topology"], "devices": report["devices"],
         "device_memory_bytes": report["device_memory_bytes"], "fits": fits,
         "peak_bytes_per_device": report["peak_bytes_per_device"],
         "per_device": report["per_device"], "programs": len(report["programs"]),
         "mesh": report["mesh"], "estimate": report["estimate"], "compiler": report["compiler"], "attention": report.get("attention"),
         "algorithm": report.get("algorithm", "es"), "compile": report.get("compile"),
         "remat_failures": len(report.get("remat_failures", [])), "partial": bool(report.get("only"))}
  if "es" in report:
    es = report["es"]
    out["es"] = {"peak_bytes_per_device": es["peak_bytes_per_device"], "per_device": es["per_device"],
                 "programs": len(es["programs"]), "compile": es.get("compile"),
                 "fits": (es["peak_bytes_per_device"] <= headroom * es["device_memory_bytes"]
                          and not es.get("remat_failures"))}
    out["es_over_grpo"] = report["es_over_grpo"]
  return out


def with_stand_in_checkpoint(config, directory: str):
  """The config, with ``model.path`` pointing at a config.json of its preset's shapes when it
  names no checkpoint: a preflight needs the shapes, not the weights (and a run of a real-size
  preset must name one, so validation asks for it)."""
  if config.model.path or config.model.preset.startswith("tiny"):
    return config
  from jaxes.models import qwen2
  cfg = qwen2.Qwen2Config.preset(config.model.preset, param_dtype=config.model.param_dtype,
                                 dtype=config.model.dtype)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f)
  config = config.copy_and_resolve_references()
  config.model.path = directory
  return config


def named_device_count(name: str) -> int | None:
  """The device count of ``NxCHIP`` and ``cpu:N`` (None for TPU slices and unknown names)."""
  if parsed := gpu_targets.parse(name):
    return parsed[1]
  m = re.fullmatch(r"cpu:(\d+)", name)
  return int(m.group(1)) if m else None


def check_mesh(config, num_devices: int, topology: str) -> None:
  """The config's mesh over the topology's devices, and its slots over the mesh's data shards: a
  ``ConfigError`` naming the key before anything is built (the engine would raise mid-build)."""
  from jaxes.train import builders
  from jaxes.errors import ConfigError
  data, _, _ = builders.mesh_shape(config, num_devices)
  if config.rollout.num_slots % data:
    raise ConfigError(f"config.rollout.num_slots: {config.rollout.num_slots} is not divisible by "
                      f"the mesh's data={data} on {topology} (every data shard holds the same "
                      f"number of slots); set config.rollout.num_slots or config.mesh")


def check_config(config) -> None:
  """``ConfigError`` naming the key for a config the preflight cannot size: the run's own checks
  (``validate``: each algorithm its own block) and, where the report sizes the config as ES too
  (``ES_COMPARED``), ES's block."""
  from jaxes.train import algorithms
  from jaxes.train.config import validate
  validate(config)
  if config.train.algorithm in ES_COMPARED:
    algorithms.ALGORITHMS["es"].check_config(config)


def mesh_mismatch(config, topology: str) -> str | None:
  """The one line refusing a config whose mesh is sized for other devices than ``topology``
  (``mesh.target`` names them), or None. Compiling its mesh over the topology would size a layout
  no run on either would use."""
  sized_for = config.mesh.target
  if not sized_for or sized_for == topology:
    return None
  m = config.mesh
  return (f"preflight: the config's mesh (data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) is sized "
          f"for mesh.target={sized_for}, not --topology={topology}: use the config's variant for "
          f"{topology} (e.g. configs/paper.py:async1,{topology}) or set --config.mesh.target and "
          f"its mesh")


def main(argv):
  from absl import flags
  from jaxes.train.config import ConfigError
  FLAGS = flags.FLAGS
  if len(argv) > 1:
    cli.usage_error("preflight", f"unexpected arguments {argv[1:]}")
  with tempfile.TemporaryDirectory() as stand_in:
    config = with_stand_in_checkpoint(FLAGS.config, stand_in)
    try:
      check_config(config)
    except ConfigError as e:
      print(f"invalid config: {e}", file=sys.stderr)
      sys.exit(2)
    topology = FLAGS.topology or config.mesh.target
    if not topology:
      cli.usage_error("preflight", "say --topology=... (the config names no mesh.target)")
    mismatch = mesh_mismatch(config, topology)
    if mismatch:
      print(mismatch, file=sys.stderr)
      sys.exit(2)
    if FLAGS.jobs < 1:
      cli.usage_error("preflight", f"--jobs must be at least 1, got {FLAGS.jobs}")
    # Every program compiled here, not read from a persistent cache: its compile seconds are the
    # measurement, and a cached program would not log the compiler's rematerialisation warning.
    jax.config.update("jax_enable_compilation_cache", False)
    try:   # before the topology's devices where their count is in the name (no compiler set-up)
      if (count := named_device_count(topology)) is not None:
        check_mesh(config, count, topology)
      with cli.without_plugin_noise():
        target = resolve_topology(topology, FLAGS.device_memory_gib, FLAGS.cpu_estimate)
      check_mesh(config, len(target.devices), topology)
    except ConfigError as e:
      print(f"invalid config: {e}", file=sys.stderr)
      sys.exit(2)
    log = (lambda *_: None) if FLAGS.json else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
      report = plan(config, target, log=log, only=FLAGS.only, jobs=FLAGS.jobs)
    except NoProgramMatches as e:
      cli.usage_error("preflight", str(e))
  lines, fits = render(report, FLAGS.headroom)
  if FLAGS.json:
    print(json.dumps(report))
  else:
    print("\n".join(lines))
  print(json.dumps(summary(report, fits, FLAGS.headroom)))
  sys.exit(0 if fits else 1)


def _define_flags():
  from absl import flags
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "An ml-collections config file (configs/*.py[:ARG]).")
  flags.DEFINE_string("topology", None, "cpu:N, 8xH100, 8xH200 (NxH100, NxH200), or a TPU slice "
                      "(v5p-64, v5e-8, ...); default: the config's mesh.target.")
  flags.DEFINE_integer("jobs", 1, "Programs compiled at once, in threads (the compilers release "
                       "the GIL); each holds its own compiler memory.")
  flags.DEFINE_bool("cpu_estimate", False, "Size a GPU target with the CPU compiler even where the "
                    "GPU compiler is installed (the estimate, to set beside the real numbers).")
  flags.DEFINE_float("headroom", 0.9, "Fraction of device memory the peak may use.")
  flags.DEFINE_float("device_memory_gib", None, "Override the memory per device (GiB).")
  flags.DEFINE_string("only", None, "Compile only the programs whose name matches this regex "
                      "(e.g. 'span=16384|reset|noiser|es_update'); the report says so.")
  flags.DEFINE_bool("json", False, "Print the full report as JSON instead of the table.")
  flags.mark_flags_as_required(["config"])


def _parse_flags(argv):
  """absl's parsing, but ``--help`` exits 0 (absl's exits 1, the code that means "does not fit")."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except SystemExit:
    if cli.wants_help(argv):
      sys.exit(0)
    raise
  except flags.Error as e:
    cli.usage_error("preflight", str(e).splitlines()[-1] if str(e).strip() else type(e).__name__)


if __name__ == "__main__":
  from absl import app
  _define_flags()
  app.run(main, flags_parser=_parse_flags)

"""Preflight: the per-device numbers are the real arrays' sizes, a config that cannot fit fails
with a line naming its biggest consumer, and the TPU compiler sizes a slice from a CPU machine."""
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxes import preflight, sharding
from jaxes.models import partition
from jaxes.rollout.engine import Engine
from jaxes.train import algorithms, builders, mc_probe
from jaxes.train.algorithms import evolution
import helpers_repo

needs_8_devices = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
ROOT = str(helpers_repo.REPO)

TINY_CONFIG = '''
from jaxes.train.defaults import base_config


def get_config(arg=""):
  c = base_config()
  c.model.preset = "tiny-gqa"
  c.model.vocab_size = 512
  c.tokenizer.vocab_size = 512
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, 1, 2
  c.es.population = 8
  c.rollout.num_slots = 8
  c.rollout.max_len = 64
  c.rollout.prefill_chunk = 2   # a small largest token bucket: cheap programs to compile
  c.rollout.max_new_tokens = 16
  return c
'''


def tiny_config():
  namespace = {}
  exec(TINY_CONFIG, namespace)
  return namespace["get_config"]()


def _device0_bytes(tree) -> int:
  """Bytes device 0 actually holds of a pytree of arrays."""
  device = jax.devices()[0]
  return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
             if s.device == device)


def _run(tmp_path, *flags):
  path = tmp_path / "tiny.py"
  path.write_text(TINY_CONFIG)
  # The suite's XLA flags (optimisation level 0: the verdict and the sizes checked here do not
  # depend on it) less the device count, which the program sets from --topology.
  xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(xla_flags.split())}
  return subprocess.run([sys.executable, "-m", "jaxes.preflight", f"--config={path}", *flags],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


# The widest step at the longest span (one version and merged versions), the noiser and the ES
# update: the programs whose sizes decide the peak, not all 12; every program's name is checked
# by test_report_matches_the_real_arrays_on_8_cpu_devices (listed, not lowered).
WIDEST = r"^(step\[t=16,span=64(,steps=1)?\]|noiser|es_update)$"


@pytest.fixture(scope="module")
def over_memory(tmp_path_factory):
  """``python -m jaxes.preflight`` on cpu:8, told a 0.0001 GiB device, compiling WIDEST: one run
  whose table and summary both tests below read (its rows against the real arrays, its verdict)."""
  out = _run(tmp_path_factory.mktemp("preflight"), "--topology=cpu:8", "--device_memory_gib=0.0001",
             f"--only={WIDEST}")
  assert out.returncode == 1, out.stderr[-2000:]
  return out.stdout.strip().splitlines()


def record_lowerings(monkeypatch) -> list[str]:
  """The names of the programs lowered from now on, in order: the lazy entries of
  ``Engine.lowerings`` and of every algorithm's ``abstract_update``, recorded as they are called."""
  names = []

  def recorded(entries: dict) -> dict:
    def entry(name, lower):
      def lower_and_record():
        names.append(name)
        return lower()
      return lower_and_record
    return {name: entry(name, lower) for name, lower in entries.items()}

  engine_lowerings = Engine.lowerings
  monkeypatch.setattr(Engine, "lowerings", lambda self: recorded(engine_lowerings(self)))
  for cls in algorithms.ALGORITHMS.values():
    def abstract_update(self, params, mesh, original=cls.abstract_update):
      update, state = original(self, params, mesh)
      return recorded(update), state
    monkeypatch.setattr(cls, "abstract_update", abstract_update)
  return names


def _program_names(lines) -> list[str]:
  """The program rows of the table: between its "programs" header and its "N programs" line."""
  start = next(i for i, line in enumerate(lines) if line.startswith("  programs"))
  end = next(i for i, line in enumerate(lines) if re.match(r"  \d+ programs, ", line))
  return [line.split()[0] for line in lines[start + 1:end]]


@pytest.mark.end_to_end
@needs_8_devices
def test_report_matches_the_real_arrays_on_8_cpu_devices(over_memory, monkeypatch):
  config = tiny_config()
  # The rows the program printed (its summary line) for the run it compiled: the resident rows
  # need no compiled program, the temporaries WIDEST.
  summary = json.loads(over_memory[-1])
  per_device = summary["per_device"]
  assert summary["devices"] == 8 and summary["mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}

  # The same run, allocated for real on the same mesh.
  cfg = builders.model_config(config, config.model.vocab_size)
  mesh = sharding.make_mesh(4, 1, 2)
  graphdef, params = partition.init_params(cfg, mesh)
  strategy = evolution.build_strategy(config)
  state = strategy.init(params, jax.random.key(0))
  noiser = jax.jit(strategy.member_noiser)(params, np.zeros(8, np.int32), np.arange(8, dtype=np.int32),
                                           np.arange(8, dtype=np.int32), run_key=state.run_key)
  engine = Engine(graphdef, cfg, num_slots=8, max_len=64, prefill_chunk=2, max_new_tokens=16,
                  stop_ids=[], im_end_id=0, mesh=mesh)
  # Async-1 with plain SGD: rows of both live versions share calls, through the updates' low-rank
  # steps (replicated: a step's bytes are whole on every device).
  cohort = strategy.cohort(state, [(0, m, float(m)) for m in range(8)])
  step = jax.jit(strategy.version_step(params, state.run_key))(*cohort)
  step_bytes = sum(x.nbytes for x in jax.tree.leaves(step))
  assert per_device["parameters"] == _device0_bytes(nnx.to_pure_dict(params))
  assert per_device["old_versions"] == per_device["parameters"]  # async, staleness <= 1
  # eval.drift: θ₀ read for evaluations (no anchor holds it) and θ_{v-1} kept for update_cosine
  assert per_device["drift_params"] == 2 * per_device["parameters"]
  assert per_device["kv_cache"] == _device0_bytes(engine.cache)
  # Per-row noise state sharded over data=4 like the engine's: a quarter of the rows' bytes.
  rows = sum(x.nbytes for x in jax.tree.leaves(noiser) if x.shape[0] == 8)
  rest = sum(x.nbytes for x in jax.tree.leaves(noiser) if x.shape[0] != 8)
  assert per_device["noiser_state"] == 2 * (rows // 4 + rest)
  assert per_device["optimizer_state"] == _device0_bytes(state.opt_state)
  # max_staleness + 2 steps registered or padding, and one stack of max_staleness steps.
  assert step_bytes > 0 and per_device["version_steps"] == 4 * step_bytes
  assert per_device["temporaries"] > 0
  assert sorted(_program_names(over_memory)) == [
      "es_update", "noiser", "step[t=16,span=64,steps=1]", "step[t=16,span=64]"]
  assert summary["programs"] == 4
  # Every program of the run: the names an --only that matches none of them lists, lowering none.
  lowered = record_lowerings(monkeypatch)
  with pytest.raises(preflight.NoProgramMatches) as unmatched:
    preflight.plan(config, preflight.resolve_topology("cpu:8"), log=lambda *_: None, only="^nothing$")
  assert lowered == []
  names = str(unmatched.value).split("programs: ", 1)[1].split(", ")
  steps = len(engine.buckets) * len(engine.spans)
  # Per-version steps and merged-versions steps; reset, noiser, es_update; a step's build, its
  # stacking and the merged noiser; the evaluation's drift measure.
  assert len(names) == 2 * steps + 7 and sum("steps=1" in n for n in names) == steps
  assert {"reset", "noiser", "es_update", "version_step", "stack_steps", "merge_noisers",
          "eval_drift"} <= set(names)
  assert summary["peak_bytes_per_device"] == sum(per_device.values())


@needs_8_devices
def test_the_evaluations_programs_are_sized_beside_the_run():
  config = tiny_config()
  config.eval.mc_probe_file = "bundled"
  target = preflight.resolve_topology("cpu:8")
  report = preflight.plan(config, target, log=lambda *_: None, only="^eval_")
  programs = {p["name"]: p for p in report["programs"]}
  assert set(programs) == {"eval_drift", "eval_mc_probe"}
  vocab, length = config.model.vocab_size, config.rollout.max_len
  # The KL of one transcript holds both policies' float32 log-softmaxes [length - 1, vocab]
  # (the CPU compiler both whole; libtpu fused the 7B config's to 1.4 of them).
  assert programs["eval_drift"]["temporaries"] >= 2 * (length - 1) * vocab * 4
  # The probe scores ROWS_PER_STEP rows at a time: their float32 logits [8, tokens - 1, vocab].
  rows, tokens = mc_probe.rows_bound(mc_probe.load_items(mc_probe.bundled_path()))
  assert programs["eval_mc_probe"]["temporaries"] >= mc_probe.ROWS_PER_STEP * (tokens - 1) * vocab * 4
  config.eval.drift, config.eval.mc_probe_file = False, ""
  with pytest.raises(preflight.NoProgramMatches):
    preflight.plan(config, target, log=lambda *_: None, only="^eval_")


@pytest.mark.end_to_end
def test_a_config_that_cannot_fit_fails_naming_its_biggest_consumer(over_memory):
  # over_memory: exit 1 (checked there), WIDEST compiled (the programs that decide the peak:
  # compiling every program of the config adds nothing to the verdict).
  lines = over_memory
  verdict = next(line for line in lines if line.startswith("does not fit"))
  summary = json.loads(lines[-1])
  biggest = max(summary["per_device"], key=summary["per_device"].get)
  assert f"biggest consumer {biggest}" in verdict and preflight.ADVICE[biggest] in verdict
  assert summary["fits"] is False and summary["devices"] == 8 and summary["programs"] == 4
  assert summary["peak_bytes_per_device"] > summary["device_memory_bytes"]
  assert summary["device_memory_bytes"] == int(0.0001 * 2**30)
  assert set(summary["per_device"]) == {"parameters", "old_versions", "kv_cache", "noiser_state",
                                        "version_steps", "optimizer_state", "drift_params",
                                        "temporaries"}


@pytest.mark.end_to_end
def test_unknown_topology_is_one_line_with_the_usage_exit_status_and_help_exits_0(tmp_path):
  out = _run(tmp_path, "--topology=v9z-8")
  assert out.returncode == 2 and out.stderr.strip().splitlines() == [
      f"preflight: unknown topology 'v9z-8'; known: cpu:N, NxH100, NxH200 (8xH100, 16xH200, ...), "
      f"{', '.join(preflight.TPU_TOPOLOGIES)}"], out.stderr   # 1 means "does not fit"
  helped = _run(tmp_path, "--help")
  assert helped.returncode == 0 and "--topology" in helped.stdout, helped.stderr


@pytest.mark.libtpu
def test_tpu_compiler_sizes_a_v5e_slice_from_a_cpu_machine(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another preflight may hold libtpu's lock
  config = tiny_config()
  target = preflight.resolve_topology("v5e-8")
  assert target.compiler == "tpu" and len(target.devices) == 8
  # The programs that decide the peak (the largest token bucket, with and without version steps,
  # and the ES update) through libtpu, not all 12: the others' names are listed and checked by
  # test_report_matches_the_real_arrays_on_8_cpu_devices.
  report = preflight.plan(config, target, log=lambda *_: None, only=r"^(es_update|step\[t=16,)")
  assert sorted(p["name"] for p in report["programs"]) == [
      "es_update", "step[t=16,span=64,steps=1]", "step[t=16,span=64]"]
  cfg = builders.model_config(config, config.model.vocab_size)
  # [L, B/data, S, KVH/tensor, hd] float32 keys and values, plus index and valid per row.
  local = cfg.num_layers * 2 * 64 * (cfg.num_kv_heads // 2) * cfg.head_size * 4
  assert report["per_device"]["kv_cache"] == 2 * local + 2 * 4 + 2 * 64
  assert report["device_kind"].startswith("TPU v5")
  assert all(p["required"] == 0 for p in report["programs"])  # everything compiled
  assert report["per_device"]["temporaries"] > 0
  assert report["attention"].startswith("blockwise (unpaged cache")   # a paged one: the kernel

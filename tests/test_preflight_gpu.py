"""Preflight on GPU targets: the real XLA GPU compiler from a machine without a GPU (skipped with the
reason where the CUDA plugin, the `gpu-aot` extra, is missing), its "could not rematerialise"
warning as a failed verdict, the labelled CPU estimate without the plugin, and the one-line refusal
of a config whose mesh is sized for other devices."""
import contextlib
import json
import os
import subprocess
import sys
import threading

import jax
import pytest

from jaxes import gpu_targets, preflight, xla_log
from jaxes.train.config import load_config_file
from tests.test_preflight import ROOT, TINY_CONFIG, tiny_config

needs_8_devices = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# Programs of the tiny config that the GPU compiler takes in well under a second each.
QUICK = r"^(reset|stack_steps|merge_noisers)$"
QUICK_AND_UPDATE = r"^(reset|stack_steps|merge_noisers|es_update)$"


@contextlib.contextmanager
def no_persistent_cache():
  """As the preflight program runs: a compile read from the suite's cache logs no warning."""
  from jax.experimental.compilation_cache import compilation_cache
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
    # JAX decides once per process whether the cache is used: if the first compile came while it
    # was off, it would stay off for every later test of this worker (tests/train/test_precompile.py's
    # warm-up checks would then see nothing written). Let the next compile decide again.
    compilation_cache.reset_cache()


def small_config():
  """tiny_config with one slot per data shard: 2 token buckets, not 3, so 18 programs to lower
  for the GPU's 3 attention spans, not 24 (those compiled here do not depend on the buckets)."""
  config = tiny_config()
  config.rollout.num_slots = 4
  return config


@pytest.fixture(scope="module")
def h100():
  """One 8xH100 plan through the real GPU compiler for the tests below: QUICK and the ES update,
  at 2 jobs, every program compiled here (no_persistent_cache)."""
  with no_persistent_cache():
    target = preflight.resolve_topology("8xH100")
    report = preflight.plan(small_config(), target, log=lambda *_: None,
                            only=QUICK_AND_UPDATE, jobs=2)
  return target, report


@pytest.mark.cuda_plugin
def test_gpu_compiler_sizes_8xH100_from_a_cpu_machine(h100):
  target, report = h100
  assert (target.compiler, target.estimate, len(target.devices)) == ("gpu", False, 8)
  assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["device_memory_bytes"] == 80e9
  assert sorted(p["name"] for p in report["programs"]) == ["es_update", "merge_noisers", "reset",
                                                           "stack_steps"]
  assert report["remat_failures"] == [] and report["compile"]["jobs"] == 2
  assert all(p["seconds"] > 0 for p in report["programs"])
  lines, fits = preflight.render(report, 0.9)
  assert fits and "(real GPU compiler, attention " in lines[0] and "at 2 job(s)" in "\n".join(lines)


@pytest.mark.cuda_plugin
def test_the_es_update_keeps_its_parameters_sharded_on_the_gpu_compiler(h100):
  # Left to its sharding propagation, the GPU compiler replicated the update's new parameters
  # over the tensor axis (this config: 2x the arguments; Qwen2.5-7B on 8xH100: 14.2 GiB more).
  _, report = h100
  (update,) = [p for p in report["programs"] if p["name"] == "es_update"]
  params = report["per_device"]["parameters"]
  assert params <= update["outputs"] < 1.5 * params   # the new parameters (+ a few scalars), sharded


@pytest.mark.cuda_plugin
@pytest.mark.skipif(gpu_targets.cudnn_installed(), reason="cuDNN is installed here")
def test_without_cudnn_the_gpu_report_says_its_attention_is_blockwise(capsys):
  target = preflight.resolve_topology("8xH100")
  assert target.attention == "blockwise (cuDNN not installed)"
  assert "cuDNN is not installed, so attention is compiled blockwise" in capsys.readouterr().err


@pytest.mark.hardware
@pytest.mark.cuda_plugin
@pytest.mark.cudnn
def test_cudnn_attention_compiles_deviceless_for_an_h100():
  from jax.sharding import NamedSharding, PartitionSpec
  from jaxes import sharding
  target = preflight.resolve_topology("8xH100")
  mesh = sharding.make_mesh(2, 1, 4, devices=target.devices)
  x = jax.ShapeDtypeStruct((2, 128, 8, 64), jax.numpy.bfloat16,
                           sharding=NamedSharding(mesh, PartitionSpec("data", None, "tensor")))
  attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                implementation="cudnn"))
  assert target.attention == "cuDNN" and "__cudnn" in attend.lower(x, x, x).compile().as_text()


@pytest.mark.end_to_end
@pytest.mark.cuda_plugin
def test_over_the_device_memory_the_gpu_compilers_warning_exits_1(tmp_path):
  # The compiler is told a 10 KiB device: it compiles anyway and only logs that it could not
  # rematerialise below it. A headroom no peak exceeds leaves that warning as the only reason.
  path = tmp_path / "tiny.py"
  path.write_text(TINY_CONFIG)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  # One slot per data shard (as small_config): fewer programs to lower, QUICK compiled alike.
  out = subprocess.run([sys.executable, "-m", "jaxes.preflight", f"--config={path}", "--topology=8xH100",
                        "--config.rollout.num_slots=4", "--device_memory_gib=0.00001", "--headroom=1e9",
                        "--jobs=2", f"--only={QUICK}"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert out.returncode == 1, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  verdict = lines[-2]
  assert verdict.startswith("does not fit: the GPU compiler could not rematerialise "), verdict
  assert "Can't reduce memory use below" in verdict
  summary = json.loads(lines[-1])
  assert summary["fits"] is False and summary["compiler"] == "gpu" and summary["remat_failures"] >= 1
  assert summary["device_memory_bytes"] == int(0.00001 * 2**30)
  assert any("could not rematerialise below it" in line for line in lines)  # marked per program


@needs_8_devices
def test_without_the_plugin_one_line_says_how_to_get_it_and_the_estimate_is_labelled(monkeypatch, capsys):
  monkeypatch.setattr(gpu_targets, "plugin_installed", lambda: False)
  target = preflight.resolve_topology("8xH200")
  err = capsys.readouterr().err.strip()
  assert err == ("preflight: 8xH200 sized by the CPU compiler (an estimate); for the real GPU "
                 "compiler: pip install -e '.[gpu-aot]'")
  assert (target.compiler, target.estimate, target.device_memory) == ("cpu", True, 141e9)


def test_a_mesh_sized_for_other_devices_is_refused_in_one_line_naming_both():
  config = load_config_file(os.path.join(ROOT, "configs", "paper.py"), "async1")  # the 8xH100 mesh
  line = preflight.mesh_mismatch(config, "v5p-64")
  assert "\n" not in line and "mesh.target=8xH100" in line and "--topology=v5p-64" in line
  assert "data=2, fsdp=1, tensor=4" in line
  assert preflight.mesh_mismatch(config, "8xH100") is None
  assert preflight.mesh_mismatch(tiny_config(), "v5p-64") is None   # no mesh.target: any topology


def test_log_lines_go_to_the_program_whose_thread_logged_them(capfd):
  # Two threads log as glog does (thread id in the prefix) and mark their program after each.
  def compile_like(name, lines):
    for text in lines:
      os.write(2, f"W1203 12:00:00.000000 {threading.get_native_id():7d} hlo_rematerialization.cc:1] "
                  f"{text}\n".encode())
    watch.mark(name)

  with xla_log.watch(xla_log.REMAT_FAILED) as watch:
    threads = [threading.Thread(target=compile_like, args=("a", ["Can't reduce memory use below 4B"])),
               threading.Thread(target=compile_like, args=("b", ["fine", "Can't reduce memory use below 8B"]))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    os.write(2, b"W1203 12:00:00.000000       1 hlo_rematerialization.cc:1] Can't reduce memory use below 2B\n")
  assert [line.split("] ")[1] for line in watch.by_label["a"]] == ["Can't reduce memory use below 4B"]
  assert [line.split("] ")[1] for line in watch.by_label["b"]] == ["Can't reduce memory use below 8B"]
  assert len(watch.unattributed) == 1   # no mark followed it
  err = capfd.readouterr().err
  assert "fine" in err and "below 2B" in err and "jaxes-xla-log-mark" not in err   # all but the marks

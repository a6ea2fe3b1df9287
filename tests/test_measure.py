"""``python -m jaxes.measure`` on this CPU at the tiniest settings (every key of its JSON line with a
value, the roofline row saying the CPU has no HBM peak), and the parts of its accelerator path a
CPU machine can check: the peak-bandwidth table against the device kinds the GPU and TPU compilers
report for their deviceless devices, the compiler's cost analysis read from a program compiled for
a v5p, and the hardware tests it selects still existing."""
import ast
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from helpers_train import launch_env
from jaxes import gpu_targets, measure
import helpers_repo

ROOT = helpers_repo.REPO


@pytest.mark.end_to_end
def test_on_cpu_every_key_has_a_value_and_the_roofline_says_why_not(tmp_path):
  # One device, rows of 64 positions, every prompt prefilled in one call, 1 decode step per mode:
  # the tiniest run of every mode.
  out = subprocess.run([sys.executable, "-m", "jaxes.measure", "--config=configs/demo.py",
                        "--model_shape=tiny", "--steps=1", "--config.rollout.max_len=64",
                        "--config.rollout.prefill_tokens=1024"],
                       capture_output=True, text=True, cwd=ROOT, env=launch_env(tmp_path), timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  report = json.loads(lines[-1])
  assert set(measure.SUMMARY_KEYS) <= set(report)
  assert report["device_kind"] == "cpu" and report["num_devices"] == 1 and report["num_slots"] == 64
  rates = report["decode_tokens_per_s"]
  assert set(rates) == {"plain", "lowrank", "two_versions"}   # the demo is low-rank: no fullrank
  assert all(r > 0 for r in rates.values())
  assert report["es_over_plain"] == pytest.approx({m: rates[m] / rates["plain"]
                                                   for m in ("lowrank", "two_versions")})
  # The demo's update is a low-rank SGD step: both versions' rows decode in one call per step.
  assert report["calls_per_step"]["two_versions"] == 1
  assert report["peak_bytes_measured"] > 0 and report["peak_bytes_predicted"] > 0
  assert report["memory_measured_over_predicted"] == pytest.approx(
      report["peak_bytes_measured"] / report["peak_bytes_predicted"])
  assert report["roofline_fraction"] is None and report["roofline"]["reason"] == "CPU: no HBM peak"
  assert any("roofline: CPU: no HBM peak" in line for line in lines)
  assert set(report["host_gap_s"]) == set(rates) and all(g >= 0 for g in report["host_gap_s"].values())
  assert report["update_s"] > 0 and report["updates_per_hour_sandbox_free"] > 0
  compiled = report["compile_s"]
  assert compiled["cold"] > 0 and compiled["programs"] >= 10
  assert compiled["cached"] > 0 and compiled["cached_programs"] >= 1
  assert report["eggroll"]["es_over_plain"] > 0 and report["eggroll"]["reported"] == 0.91
  assert report["hardware_tests"] == {"platform": "cpu", "status": "none for this platform"}
  assert report["jax"] == jax.__version__ and report["date"] and report["machine"]


def _bytes_of_a_matmul(devices) -> float:
  """The compiler's bytes for a [256, 512] @ [512, 512] bfloat16 matmul on ``devices[0]``."""
  mesh = Mesh(np.array(devices[:1]), ("data",))
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
  return measure.program_bytes(jax.jit(lambda x, w: x @ w).lower(spec((256, 512)), spec((512, 512))).compile())


@pytest.mark.skipif(not gpu_targets.plugin_installed(),
                    reason="the CUDA plugin is not installed (pip install -e '.[gpu-aot]')")
def test_an_h100s_kind_has_its_peak():
  devices = gpu_targets.devices("1xH100")
  bandwidth, source = measure.peak_bandwidth(devices[0].device_kind)
  assert bandwidth == 3.35e12 and "H100" in source
  # The compile-only GPU client has no cost analysis: the report's compiler bytes are None there
  # (a GPU's own client has them); the roofline itself counts weights and KV from the arrays.
  assert _bytes_of_a_matmul(devices) is None


def test_a_v5ps_kind_has_its_peak_and_its_compiler_counts_bytes(monkeypatch):
  pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[tpu]')")
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock
  from jax.experimental import topologies
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  assert measure.peak_bandwidth(devices[0].device_kind)[0] == 2.765e12
  moved = 2 * (256 * 512 + 512 * 512 + 256 * 512)
  assert moved <= _bytes_of_a_matmul(devices) < 4 * moved


def test_the_table_names_each_kind_and_no_peak_is_invented():
  assert measure.peak_bandwidth("NVIDIA H200")[0] == 4.8e12
  assert measure.peak_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
  assert measure.peak_bandwidth("TPU v5 lite")[0] == 8.19e11
  assert measure.peak_bandwidth("TPU v6 lite")[0] == 1.638e12
  assert measure.peak_bandwidth("cpu") == (None, "CPU: no HBM peak")
  bandwidth, reason = measure.peak_bandwidth("NVIDIA B200")
  assert bandwidth is None and "PEAK_HBM" in reason


def test_the_selected_hardware_tests_exist():
  for selection in measure.HARDWARE_TESTS.values():
    for node in selection:
      path, _, name = node.partition("::")
      tree = ast.parse((ROOT / path).read_text())
      assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, node


def test_a_qwen_shape_replaces_the_configs_model_and_every_slot_is_a_member():
  from jaxes.train import builders
  from jaxes.train.config import load_config_file
  demo = lambda: load_config_file(ROOT / "configs" / "demo.py")
  config = measure.measure_config(demo(), "0.5B", num_devices=8)
  assert config.model.preset == "qwen2.5-0.5b" and config.model.dtype == "bfloat16"
  model = builders.build_model(config, measure.vocab_size(config))
  assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (24, 896, 151936)
  assert config.rollout.num_slots == 64 and config.es.population == 64
  with pytest.raises(ValueError, match="model_shape"):
    measure.measure_config(demo(), "3B", num_devices=1)

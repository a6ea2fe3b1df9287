"""``python -m jaxes.measure`` on this CPU at the tiniest settings (every key of its JSON line with a
value, the roofline row saying the CPU has no HBM peak), and the hardware-only tests its report
names for an accelerator: marked ``hardware``, and still there. (Its sizing: tests/test_sizing.py;
the decode it times: tests/test_measure_decode.py.)"""
import ast
import json
import subprocess
import sys

import jax
import pytest

from helpers_train import launch_env
from jaxes import measure
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


def _marked_hardware() -> set[str]:
  """Every test function of the suite decorated ``@pytest.mark.hardware``."""
  marked = set()
  for path in (ROOT / "tests").rglob("test_*.py"):
    for f in ast.walk(ast.parse(path.read_text())):
      if isinstance(f, ast.FunctionDef) and any(ast.unparse(d) == "pytest.mark.hardware" for d in f.decorator_list):
        marked.add(f"{path.relative_to(ROOT)}::{f.name}")
  return marked


def test_the_hardware_tests_are_marked_and_each_platform_has_its_command():
  assert _marked_hardware() >= {
    "tests/models/test_kernels_tpu.py::test_on_a_tpu_the_kernel_matches_the_portable_path",
    "tests/models/test_kernels_tpu.py::test_a_gpu_target_is_the_gpu_platform_and_its_lowering_asks_cudnn",
    "tests/test_preflight_gpu.py::test_cudnn_attention_compiles_deviceless_for_an_h100"}
  assert set(measure.HARDWARE_TESTS) == {"gpu", "tpu"}
  assert all("-m hardware" in command for command in measure.HARDWARE_TESTS.values())



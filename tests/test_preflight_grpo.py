"""Preflight of a GRPO config: the learner's rows are the bytes a real learner state holds on a
device, the learner step's arguments are those rows, and ES's report for the same model and mesh
stands beside it."""
import jax
import numpy as np
import pytest
from flax import nnx

from jaxes import preflight, sharding
from jaxes.models import partition
from jaxes.rl import config as rl_config
from jaxes.rl.batch import Batch
from jaxes.rl.grpo import GRPOLearner
from jaxes.train import builders
from tests.test_preflight import record_lowerings

needs_8_devices = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# The widest step at the longest span, the learner step and the ES update: the programs whose
# sizes decide the peak; compiling every width x span twice (GRPO's engine and ES's) is slow.
ONLY = r"step\[t=40,span=64\]|grpo_step|es_update"


def tiny_grpo_config():
  from jaxes.train.defaults import base_config
  c = base_config()
  c.model.preset = "tiny-gqa"
  c.model.vocab_size = 512
  c.model.param_dtype = c.model.dtype = "bfloat16"   # so the learner keeps a float32 master
  c.tokenizer.vocab_size = 512
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, 1, 2
  c.es.population = 8
  c.rollout.num_slots = 8
  c.rollout.max_len = 64
  c.rollout.prefill_chunk = 8
  c.rollout.max_new_tokens = 16
  c.rollout.temperature = 1.0
  c.train.algorithm = "grpo"
  c.controller.mode, c.controller.max_staleness = "sync", 0
  c.grpo = rl_config.default_config()
  c.grpo.group_size, c.grpo.tasks_per_update, c.grpo.micro_batches = 4, 2, 2
  return c


def _device0_bytes(tree) -> int:
  device = jax.devices()[0]
  return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
             if s.device == device)


@needs_8_devices
def test_grpo_report_matches_a_real_learner_state_and_its_compiled_step():
  config = tiny_grpo_config()
  report = preflight.plan(config, preflight.resolve_topology("cpu:8"), log=lambda *_: None, only=ONLY)
  rows = report["per_device"]
  assert report["algorithm"] == "grpo" and report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}
  assert set(rows) == {"parameters", "old_versions", "kv_cache", "master_weights", "optimizer_state",
                       "reference_params", "learner_batch", "drift_params", "temporaries"}
  assert rows["old_versions"] == 0 and rows["reference_params"] == 0  # sync, kl_coef 0
  assert [p["name"] for p in report["programs"]] == ["step[t=40,span=64]", "grpo_step"]

  # The same learner state, allocated for real on the same mesh.
  cfg = builders.model_config(config, config.model.vocab_size)
  mesh = sharding.make_mesh(4, 1, 2)
  graphdef, params = partition.init_params(cfg, mesh)
  learner = GRPOLearner(graphdef, rl_config.from_run_config(config))
  state = learner.init(params)
  assert rows["parameters"] == _device0_bytes(nnx.to_pure_dict(params))
  # float32 of bf16, split over the 4 data shards too (grpo.optimizer_over_data)
  assert rows["master_weights"] == _device0_bytes(state.master) == 2 * rows["parameters"] // 4
  assert {x.sharding for x in jax.tree.leaves(state.params)} & {
      x.sharding for x in jax.tree.leaves(state.master)} == set()
  assert rows["optimizer_state"] == _device0_bytes(state.opt_state)
  assert rows["optimizer_state"] >= 4 * rows["parameters"] // 4  # two float32 moments (+ counters)

  # The batch over data: 8 rows x 64 tokens of int32 + bool + bool + float32, and [8] rewards, groups.
  over_data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  n, s = 8, 64
  batch = Batch(*(jax.device_put(np.zeros(shape, dtype), over_data) for shape, dtype in (
      ((n, s), np.int32), ((n, s), bool), ((n, s), bool), ((n, s), np.float32), ((n,), np.float32),
      ((n,), np.int32))))
  assert rows["learner_batch"] == _device0_bytes(batch) == (n // 4) * (s * 10 + 8)

  # The learner step's compiled arguments are exactly the learner rows; the real step compiles
  # to the same memory the report read from the abstract one.
  step = next(p for p in report["programs"] if p["name"] == "grpo_step")
  assert step["arguments"] == sum(rows[k] for k in ("parameters", "master_weights", "optimizer_state",
                                                    "reference_params", "learner_batch")) + 4  # + step counter
  real = learner.lower(state, batch).compile().memory_analysis()
  assert (real.temp_size_in_bytes, real.argument_size_in_bytes) == (step["temporaries"], step["arguments"])
  assert step["aliased"] > 0  # the state is donated
  assert report["peak_bytes_per_device"] == sum(rows.values())

  # ES beside it: the same model and mesh, its own rows, and the ratio of the two peaks.
  es = report["es"]
  assert es["algorithm"] == "es" and es["mesh"] == report["mesh"]
  assert es["per_device"]["parameters"] == rows["parameters"]
  assert es["per_device"]["kv_cache"] == rows["kv_cache"]
  assert "es_update" in {p["name"] for p in es["programs"]}
  assert report["es_over_grpo"] == es["peak_bytes_per_device"] / report["peak_bytes_per_device"]
  assert report["es_over_grpo"] < 1  # ES keeps no master copy, no moments, no activations for backprop

  lines, fits = preflight.render(report, headroom=0.9)
  assert lines[0].startswith("GRPO on cpu:8") and any(line.strip().startswith("ES on cpu:8") for line in lines)
  assert any(line.startswith("ES / GRPO peak per device") for line in lines)
  assert lines[-1].startswith("fits") == fits
  summary = preflight.summary(report, fits)
  assert summary["algorithm"] == "grpo" and summary["es_over_grpo"] == report["es_over_grpo"]
  assert summary["es"]["peak_bytes_per_device"] == es["peak_bytes_per_device"]


def test_grpo_config_is_checked_by_the_learners_rules():
  from jaxes.train.config import ConfigError, validate
  config = tiny_grpo_config()
  validate(config)
  config.rollout.temperature = 0.0
  with pytest.raises(ConfigError, match="config.rollout.temperature"):
    validate(config)
  config.rollout.temperature = 1.0
  config.es.population = 3   # odd: ES would refuse it; a GRPO run has no es block to check
  validate(config)
  # ... but the preflight sizes a GRPO config as ES beside it, so it checks ES's block too.
  with pytest.raises(ConfigError, match=r"config\.es\.population: must be even"):
    preflight.check_config(config)


@needs_8_devices
def test_only_the_learner_step_sizes_grpo_alone_and_an_unmatched_only_names_the_programs(monkeypatch):
  config = tiny_grpo_config()
  target = preflight.resolve_topology("cpu:8")
  lowered = record_lowerings(monkeypatch)
  report = preflight.plan(config, target, log=lambda *_: None, only="grpo_step")
  assert [p["name"] for p in report["programs"]] == ["grpo_step"] and "es" not in report
  assert lowered == ["grpo_step"]   # neither engine's steps, nor the ES side's update
  with pytest.raises(preflight.NoProgramMatches, match=r"--only='nothing' matches none of the grpo "
                     r"programs: .*grpo_step"):
    preflight.plan(config, target, log=lambda *_: None, only="nothing")

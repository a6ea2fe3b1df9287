"""The run ``jaxes.measure`` measures: a Qwen2.5 shape in place of the config's model with a member
per slot, the decode modes of a config, and each slot's (version, member) in a mode. (The steady
decode itself runs in tests/test_measure.py's command.)"""
import types

import pytest

from jaxes import measure_decode
from jaxes.train import builders
from jaxes.train.config import load_config_file
import helpers_repo

ROOT = helpers_repo.REPO


def demo():
  return load_config_file(ROOT / "configs" / "demo.py")


def test_a_qwen_shape_replaces_the_configs_model_and_every_slot_is_a_member():
  config = measure_decode.measure_config(demo(), "0.5B", num_devices=8)
  assert config.model.preset == "qwen2.5-0.5b" and config.model.dtype == "bfloat16"
  model = builders.build_model(config)
  assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (24, 896, 151936)
  assert config.rollout.num_slots == 64 and config.es.population == 64
  with pytest.raises(ValueError, match="model_shape"):
    measure_decode.measure_config(demo(), "3B", num_devices=1)


def test_the_modes_of_a_lowrank_config_and_of_a_full_rank_one():
  config = measure_decode.measure_config(demo(), "tiny", num_devices=1)
  modes = measure_decode.modes(config)
  assert list(modes) == ["plain", "lowrank", "two_versions"]
  assert [es for _, es in modes.values()] == [False, True, True]
  assert modes["two_versions"][0].controller.mode == "async"
  assert modes["two_versions"][0].controller.max_staleness >= 1
  config.es.mode = "full"
  assert list(measure_decode.modes(config)) == ["plain", "lowrank", "fullrank", "two_versions"]
  config.controller.mode, config.controller.max_staleness = "sync", 0
  assert measure_decode.run_mode(config) == "fullrank"
  config.controller.mode, config.controller.max_staleness = "async", 1
  assert measure_decode.run_mode(config) == "two_versions"


def test_rows_every_slot_its_member_or_one_member_per_data_shard():
  engine = lambda slices: types.SimpleNamespace(num_slots=8, shards=2,
                                                policy=types.SimpleNamespace(member_slices=slices))
  assert measure_decode.rows(engine(False), "lowrank") == ([0] * 8, list(range(8)))
  assert measure_decode.rows(engine(False), "two_versions") == ([0, 1] * 4, list(range(8)))
  assert measure_decode.rows(engine(True), "fullrank") == ([0] * 8, [0] * 4 + [1] * 4)
  assert measure_decode.rows(engine(True), "two_versions") == ([0] * 4 + [1] * 4, [0] * 4 + [1] * 4)

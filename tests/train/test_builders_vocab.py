"""The model's vocabulary, decided by ``builders.vocab_size`` alone: the config's size where set,
else the tokenizer's, else (no tokenizer at hand: the preflight, measure) the preset's."""
import pytest

from jaxes.train import builders
from jaxes.train.config import ConfigError
from jaxes.train.defaults import base_config


def test_the_configs_size_then_the_tokenizers_then_the_presets():
  config = base_config()
  config.model.preset = "qwen2.5-7b"
  assert builders.vocab_size(config, 400) == 400
  assert builders.vocab_size(config) == 152064
  config.model.vocab_size = 1024
  assert builders.vocab_size(config, 400) == builders.vocab_size(config) == 1024


def test_the_model_is_built_at_that_size_and_never_below_the_tokenizer():
  config = base_config()
  config.model.preset = "tiny"
  assert builders.build_model(config).config.vocab_size == 512
  assert builders.build_model(config, 600).config.vocab_size == 600
  config.model.vocab_size = 520
  with pytest.raises(ConfigError, match="520 < the tokenizer's 600 tokens"):
    builders.build_model(config, 600)

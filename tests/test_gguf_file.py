"""GGUF files as a model source: tiny files written here as llama.cpp's converter writes them
(Llama's q/k rows permuted, F32 or quantized), read against the model that made them and against
transformers' own GGUF reader; the tokenizer and chat template from the file; one-line errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxes import tokenization
from jaxes.models import check_logits, qwen2, sources
from jaxes.models.safetensors_io import CheckpointError
from helpers_models import hf_logits, save_random_hf_checkpoint, tiny_tokenizer, write_gguf

LLAMA = qwen2.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e5,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=512,
                          architecture="LlamaForCausalLM", attention_bias=False)
forward = jax.jit(qwen2.forward, static_argnums=0)


def _logits(graphdef, params, tokens):
  T = tokens.shape[1]
  out, _ = forward(graphdef, params, jnp.asarray(tokens), jnp.tile(jnp.arange(T), (len(tokens), 1)),
                   jnp.ones(tokens.shape, bool))
  return np.asarray(out)


def _leaf_paths(params):
  return {"/".join(str(k.key) for k in path)
          for path, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params))}


@pytest.mark.parametrize("tied, tensor_type", [(True, "F32"), (False, "Q8_0"), (True, "Q4_1")])
def test_llama_gguf_reads_as_transformers_reads_it(tmp_path, tied, tensor_type):
  cfg = qwen2.Qwen2Config(**{**LLAMA.__dict__, "tie_word_embeddings": tied})
  torch_model = save_random_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=4)
  path = str(tmp_path / "tiny.gguf")
  write_gguf(path, torch_model, cfg, tensor_type)
  loaded, graphdef, params = sources.load(path)
  assert loaded == cfg   # architecture, no attention bias, tied head: all from the file
  assert not [p for p in _leaf_paths(params) if p.endswith("bias")]

  # transformers' own GGUF reader (its dequantization and its undoing of the q/k permutation)
  # gives the same tensors bit for bit, so the same logits.
  reference = check_logits.transformers_model(path, "LlamaForCausalLM", "float32")
  for name, tensor in reference.state_dict().items():
    if name == "lm_head.weight" and tied:
      continue
    np.testing.assert_array_equal(sources.gguf_file.checkpoint_tensors(path)[name].open(),
                                  tensor.numpy(), err_msg=name)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 9))
  np.testing.assert_allclose(_logits(graphdef, params, tokens), hf_logits(reference, tokens), atol=1e-4, rtol=0)
  if tensor_type == "F32":   # unquantized: the model the file was written from, exactly
    np.testing.assert_allclose(_logits(graphdef, params, tokens), hf_logits(torch_model, tokens),
                               atol=1e-4, rtol=0)


def test_qwen2_gguf_keeps_its_biases_and_row_order(tmp_path):
  cfg = qwen2.Qwen2Config(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, max_position_embeddings=256)
  torch_model = save_random_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=2)
  path = str(tmp_path / "qwen.gguf")
  write_gguf(path, torch_model, cfg)
  loaded, graphdef, params = sources.load(path)
  assert loaded == cfg
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (1, 8))
  np.testing.assert_allclose(_logits(graphdef, params, tokens), hf_logits(torch_model, tokens),
                             atol=1e-4, rtol=0)


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
  pytest.importorskip("torch")   # transformers reads a GGUF tokenizer with its torch-based reader
  tokenizer = tiny_tokenizer(str(tmp_path / "tok"), vocab_size=300)
  cfg = qwen2.Qwen2Config(**{**LLAMA.__dict__, "vocab_size": len(tokenizer)})
  torch_model = save_random_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=1)
  path = str(tmp_path / "chat.gguf")
  write_gguf(path, torch_model, cfg, tokenizer=tokenizer)
  assert sources.has_tokenizer(path)
  loaded = sources.load_tokenizer(path)
  assert loaded.chat_template == tokenizer.chat_template
  messages = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "ls -la | grep py, then <command>echo hi</command>"}]
  text = tokenization.chat_prompt(messages)
  assert loaded.encode(text) == tokenizer.encode(text)
  assert loaded.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == \
         tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])


def _bare_gguf(path, arch="llama", **keys):
  import gguf
  writer = gguf.GGUFWriter(path, arch)
  for key, value in keys.items():
    writer.add_key_value(key, *value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_unsupported_files_fail_in_one_line(tmp_path):
  import gguf
  bad = str(tmp_path / "gpt2.gguf")
  _bare_gguf(bad, arch="gpt2")
  with pytest.raises(CheckpointError, match=r"gpt2\.gguf: general\.architecture='gpt2' is not supported"):
    sources.read_config(bad)
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"\x00" * 64)
  with pytest.raises(CheckpointError, match=r"garbage\.gguf: not a readable GGUF file"):
    sources.read_config(str(garbage))
  with pytest.raises(CheckpointError, match=r"missing\.gguf: file not found"):
    sources.load(str(tmp_path / "missing.gguf"))

  torch_model = save_random_hf_checkpoint(str(tmp_path / "hf"), LLAMA, seed=0)
  scaled = str(tmp_path / "scaled.gguf")
  write_gguf(scaled, torch_model, LLAMA,
             **{"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING)})
  with pytest.raises(CheckpointError, match=r"rope scaling .*'linear'.* is not supported") as error:
    sources.read_config(scaled)
  assert "\n" not in str(error.value)


def test_a_quant_type_gguf_cannot_dequantize_is_named(tmp_path):
  import gguf
  torch_model = save_random_hf_checkpoint(str(tmp_path / "hf"), LLAMA, seed=0)
  path = str(tmp_path / "q8_1.gguf")
  write_gguf(path, torch_model, LLAMA)
  # Rewrite one tensor as Q8_1 (a type llama.cpp uses only for activations: no dequantizer).
  reader = gguf.GGUFReader(path)
  writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
  for key, field in reader.fields.items():
    if not key.startswith(("GGUF.", "general.architecture")):
      value_type = field.types[0]
      sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
      writer.add_key_value(key, field.contents(), value_type, sub_type)
  q8_1 = gguf.GGMLQuantizationType.Q8_1
  for t in reader.tensors:
    if t.name == "blk.1.ffn_up.weight":
      rows, cols = int(t.shape[1]), int(t.shape[0])
      raw = np.zeros(gguf.quants.quant_shape_to_byte_shape((rows, cols), q8_1), np.uint8)
      writer.add_tensor(t.name, raw, raw_dtype=q8_1)
    else:
      writer.add_tensor(t.name, np.asarray(t.data))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(CheckpointError, match=r"odd\.gguf: tensor 'blk\.1\.ffn_up\.weight' is of type Q8_1"):
    sources.load(str(tmp_path / "odd.gguf"))

"""HF checkpoint load/export: exact round trips, transformers reads our export, clear errors."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxes.models import hf, qwen2
from jaxes.models.hf_config import UnsupportedConfigError
from jaxes.models.safetensors_io import CheckpointError
from helpers_models import hf_logits, save_random_hf_checkpoint

CFG = qwen2.Qwen2Config(vocab_size=89, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("hf"))
  return path, save_random_hf_checkpoint(path, CFG, seed=5)


def _pure(params):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("max_shard_bytes", [2**30, 20_000])
def test_load_export_load_is_exact(checkpoint, tmp_path, max_shard_bytes):
  path, torch_model = checkpoint
  cfg, _, params = hf.load(path)
  hf.save(str(tmp_path), cfg, params, max_shard_bytes=max_shard_bytes)
  files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
  assert (len(files) > 1) == (max_shard_bytes < 2**30)
  assert os.path.exists(tmp_path / hf.INDEX_FILE) == (len(files) > 1)
  cfg2, _, params2 = hf.load(str(tmp_path))
  assert cfg2 == cfg
  _assert_trees_equal(_pure(params), _pure(params2))

  # transformers itself reads the export and computes the same logits as the original.
  import transformers
  exported = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path)).eval()
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 6))
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(torch_model, tokens),
                             atol=1e-5, rtol=0)


def test_bfloat16_checkpoint_round_trip_is_bitwise(tmp_path):
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=70)
  save_random_hf_checkpoint(str(tmp_path / "a"), cfg, seed=1, torch_dtype="bfloat16")
  loaded_cfg, graphdef, params = hf.load(str(tmp_path / "a"))
  assert loaded_cfg.param_dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  hf.save(str(tmp_path / "b"), loaded_cfg, params)
  original = hf.checkpoint_tensors(str(tmp_path / "a"))
  exported = hf.checkpoint_tensors(str(tmp_path / "b"))
  assert sorted(original) == sorted(exported)
  for name, info in original.items():
    np.testing.assert_array_equal(info.open().view(np.uint16), exported[name].open().view(np.uint16))


def _copy(checkpoint, tmp_path):
  dst = str(tmp_path / "ckpt")
  shutil.copytree(checkpoint[0], dst)
  return dst


def _edit_config(path, **changes):
  with open(os.path.join(path, "config.json")) as f:
    d = json.load(f)
  d.update(changes)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(d, f)


@pytest.mark.parametrize("changes, message", [
  (dict(architectures=["LlamaForCausalLM"]), "architectures=.*LlamaForCausalLM"),
  (dict(model_type="llama"), "model_type='llama'"),
  (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
  (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
   "rope_parameters.rope_type='yarn'"),
  (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_config_names_the_key(checkpoint, tmp_path, changes, message):
  path = _copy(checkpoint, tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(UnsupportedConfigError, match=message):
    hf.load(path)


def test_shape_mismatch_names_the_tensor(checkpoint, tmp_path):
  path = _copy(checkpoint, tmp_path)
  _edit_config(path, intermediate_size=50)
  with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\[48, 32\].*\[50, 32\]"):
    hf.load(path)


def test_missing_and_corrupt_files_name_the_file(checkpoint, tmp_path):
  path = _copy(checkpoint, tmp_path)
  weights = os.path.join(path, "model.safetensors")
  with open(weights, "rb") as f:
    data = f.read()
  with open(weights, "wb") as f:  # truncated: the last tensor runs past the end
    f.write(data[:-100])
  with pytest.raises(CheckpointError, match="model.safetensors: tensor .* extends past the end"):
    hf.load(path)
  with open(weights, "wb") as f:  # garbage header
    f.write(b"\xff" * 64)
  with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
    hf.load(path)
  os.remove(weights)
  with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
    hf.load(path)
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(CheckpointError, match="config.json: file not found"):
    hf.load(path)


def test_missing_and_unexpected_tensors_are_named(checkpoint, tmp_path):
  path, _ = checkpoint
  tensors = hf.checkpoint_tensors(path)
  from jaxes.models.safetensors_io import write_file

  def rewrite(dst, names, extra=None):
    os.makedirs(dst)
    shutil.copy(os.path.join(path, "config.json"), dst)
    specs = [(n, tensors[n].shape, tensors[n].dtype) for n in names]
    fetch = lambda n: tensors[n].open()
    if extra:
      specs.append((extra, (2,), np.dtype(np.float32)))
      fetch = lambda n: np.zeros(2, np.float32) if n == extra else tensors[n].open()
    write_file(os.path.join(dst, "model.safetensors"), specs, fetch)
    return dst

  missing = rewrite(str(tmp_path / "missing"),
                    [n for n in tensors if n != "model.layers.1.self_attn.k_proj.bias"])
  with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.bias'.*missing"):
    hf.load(missing)
  extra = rewrite(str(tmp_path / "extra"), list(tensors), extra="model.layers.0.mystery.weight")
  with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['model\.layers\.0\.mystery\.weight'\]"):
    hf.load(extra)


def test_index_pointing_to_a_missing_file(checkpoint, tmp_path):
  path, _ = checkpoint
  cfg, _, params = hf.load(path)
  hf.save(str(tmp_path), cfg, params, max_shard_bytes=20_000)
  second = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
  os.remove(tmp_path / second)
  with pytest.raises(CheckpointError, match=f"{second}: file not found"):
    hf.load(str(tmp_path))


@pytest.mark.parametrize("tied", [True, False])
def test_llama_checkpoint_loads_without_biases_and_exports_as_llama(tmp_path, tied):
  cfg = qwen2.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=40, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e5,
                          tie_word_embeddings=tied, architecture="LlamaForCausalLM",
                          attention_bias=False)
  torch_model = save_random_hf_checkpoint(str(tmp_path / "a"), cfg, seed=3)
  loaded, _, params = hf.load(str(tmp_path / "a"))
  assert loaded == cfg
  leaves = ["/".join(str(k.key) for k in path) for path, _ in
            jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(params))]
  assert not [p for p in leaves if p.endswith("bias")] and ("lm_head/kernel" in leaves) != tied
  hf.save(str(tmp_path / "b"), loaded, params)
  with open(tmp_path / "b" / "config.json") as f:
    written = json.load(f)
  assert (written["architectures"], written["model_type"], written["attention_bias"]) == \
         (["LlamaForCausalLM"], "llama", False)
  import transformers
  exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "b")).eval()
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 7))
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(torch_model, tokens),
                             atol=1e-5, rtol=0)


@pytest.mark.parametrize("changes, message", [
  (dict(attention_bias=True), r"q_proj\.bias.*missing"),   # a biased Llama's checkpoint carries them
  (dict(mlp_bias=True), "mlp_bias"),
  (dict(model_type="mistral"), "model_type='mistral'"),
])
def test_llama_config_errors(tmp_path, changes, message):
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=50, head_dim=16, architecture="LlamaForCausalLM",
                                 attention_bias=False)
  save_random_hf_checkpoint(str(tmp_path), cfg)
  _edit_config(str(tmp_path), **changes)
  with pytest.raises((UnsupportedConfigError, CheckpointError), match=message):
    hf.load(str(tmp_path))
  with pytest.raises(ValueError, match="attention_bias must be True for Qwen2ForCausalLM"):
    qwen2.Qwen2Config.preset("tiny", attention_bias=False)

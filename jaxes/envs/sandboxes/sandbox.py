"""The one interface every sandbox backend implements (local namespaces, docker)."""
from __future__ import annotations

import abc
import codecs
import dataclasses

from jaxes.envs.tasks.task import Task


class SandboxError(RuntimeError):
  """The sandbox failed: it could not start, or broke during the episode. Once the agent has
  acted, its actions may have caused it (``protocol.Episode`` then scores a failed episode),
  unless it is a ``HostError``."""


class HostError(SandboxError):
  """A failure no agent action can cause (the host out of processes or memory, the episode's
  host-side directory gone, the container engine unreachable): the episode is retried, and left
  out of fitness when the retries fail too."""


@dataclasses.dataclass(frozen=True)
class ExecResult:
  exit_code: int          # -1 when killed by the timeout
  output: str             # stdout+stderr interleaved, decoded with errors="replace", capped
  timed_out: bool
  output_chars: int       # true length before capping


@dataclasses.dataclass(frozen=True)
class TestReport:
  passed: bool            # every final test passed
  num_passed: int
  num_tests: int
  timed_out: bool
  report: str             # human-readable log

  @property
  def fraction(self) -> float:
    return self.num_passed / self.num_tests if self.num_tests else 0.0


# One rule for a command both backends can carry: docker hands it to bash as one argv string
# (execve refuses a NUL byte and a single string over 128 KiB, MAX_ARG_STRLEN); the local
# backend's stdin could carry both. A command breaking it is refused, on both, before it runs.
MAX_COMMAND_BYTES = 128 * 1024 - 1


def refused_command(command: str) -> ExecResult | None:
  """The result of a command neither backend runs (a NUL byte, or longer than
  MAX_COMMAND_BYTES in UTF-8): exit status 2 and one line saying why, as bash would answer a
  usage error; None for a command to run."""
  if "\0" in command:
    why = "it contains a NUL byte"
  elif len(command.encode("utf-8", "surrogatepass")) > MAX_COMMAND_BYTES:
    why = f"it is longer than {MAX_COMMAND_BYTES} bytes"
  else:
    return None
  line = f"command refused, not run: {why}\n"
  return ExecResult(exit_code=2, output=line, timed_out=False, output_chars=len(line))


class SandboxHandle(abc.ABC):
  """One live episode's sandbox. ``close`` is idempotent and never raises."""

  @abc.abstractmethod
  def exec(self, command: str, timeout_s: float) -> ExecResult: ...

  @abc.abstractmethod
  def run_tests(self) -> TestReport: ...

  @abc.abstractmethod
  def close(self) -> None: ...

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class Sandbox(abc.ABC):
  """A backend: starts episodes. ``shutdown`` removes everything it ever created."""

  @abc.abstractmethod
  def start(self, task: Task) -> SandboxHandle: ...

  def shutdown(self) -> None:
    pass

  def check_verifier(self, tasks) -> None:
    """Raises SandboxError (one line saying what to install) where this backend's verifier
    lacks what ``tasks`` need, so a run refuses at start instead of losing those tasks one
    SANDBOX_ERROR at a time. Backends with a known verifier runtime need nothing here."""

  def leftovers(self) -> dict[str, int]:
    """Counts of things this backend created that still exist (e.g. {"directories": 0})."""
    return {}


class OutputCapture:
  """Collects a command's output as it streams: keeps the first and last ``limit // 2``
  characters and counts all of them, so a flood of output costs O(limit) memory."""

  def __init__(self, limit: int):
    self._half = max(limit // 2, 1)
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self._head: list[str] = []
    self._head_len = 0
    self._tail = ""
    self.total_chars = 0

  def feed(self, data: bytes, final: bool = False) -> None:
    text = self._decoder.decode(data, final)
    if not text:
      return
    self.total_chars += len(text)
    if self._head_len < self._half:
      take = text[:self._half - self._head_len]
      self._head.append(take)
      self._head_len += len(take)
      text = text[len(take):]
    if text:
      self._tail = (self._tail + text)[-self._half:]

  def text(self) -> str:
    """Head and tail; when characters were dropped, a marker line says how many."""
    self.feed(b"", final=True)
    head = "".join(self._head)
    omitted = self.total_chars - len(head) - len(self._tail)
    if omitted <= 0:
      return head + self._tail
    return f"{head}\n[... {omitted} characters omitted ...]\n{self._tail}"

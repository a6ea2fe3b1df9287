"""The one interface every sandbox backend implements (local namespaces, docker)."""
from __future__ import annotations

import abc
import dataclasses

from jaxes.envs.task import Task


class SandboxError(RuntimeError):
  """Infrastructure failure (not the agent's fault): start failed, container died, …"""


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

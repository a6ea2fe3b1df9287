"""A terminal task: what the agent is asked, how the sandbox starts, how success is tested."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-episode limits; defaults follow Endless Terminals (16 turns, 300 s, 10 s/command)."""
  max_turns: int = 16
  episode_timeout_s: float = 300.0
  command_timeout_s: float = 10.0
  test_timeout_s: float = 60.0
  cpu_s: int = 60              # RLIMIT_CPU per command
  memory_mb: int = 2048        # address space / container memory
  processes: int = 256         # RLIMIT_NPROC / container pids
  file_size_mb: int = 256      # RLIMIT_FSIZE
  disk_mb: int = 1024          # local backend: size cap of the episode's files (and of each /tmp)
  cpus: float = 1.0            # docker backend: the container's CPU quota (at most the sandbox's)
  output_chars: int = 50_000   # observation cap (head + tail kept)


@dataclasses.dataclass(frozen=True)
class Task:
  """One task. Paths the agent sees are under /home/user.

  setup:       bash run once as root in a fresh sandbox before the agent starts (builds the
               initial state); working directory /home/user.
  files:       extra files placed before ``setup`` runs: absolute sandbox path -> bytes.
  final_tests: source of a stdlib-only pytest file; all tests pass iff the task is solved.
  initial_tests: optional pytest source that must pass right after setup.
  solution:    optional bash reference solution (the oracle).
  image:       docker image built from the task's own recipe (jaxes.envs.images.task_images); None:
               the sandbox's shared image. Only the docker backend runs such tasks.
  workdir:     the image's working directory (where a Harbor test.sh runs); None: /home/user.
  verifier_files: a Harbor ``tests/`` folder (path relative to it -> bytes); when given,
               its ``test.sh`` is the verifier instead of ``final_tests``.
  """
  name: str
  instruction: str
  setup: str = ""
  final_tests: str = ""
  initial_tests: str | None = None
  solution: str | None = None
  files: tuple[tuple[str, bytes], ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  limits: Limits = dataclasses.field(default_factory=Limits)
  family: str = "external"
  difficulty: int = 1
  seed: int | None = None
  image: str | None = None
  workdir: str | None = None
  verifier_files: tuple[tuple[str, bytes], ...] = ()

  @property
  def tests_run_agent_code(self) -> bool:
    """Whether the task's tests import or execute a file from the agent's home (read from their
    source, ``final_tests.runs_agent_code``; check's ``agent_code`` column). Modules they import
    run in a process of the agent's own (``agent_proxy``); a task whose verdict that cannot make
    safe is ``final_tests.unsafe_verdict``'s."""
    from jaxes.envs.tasks import final_tests   # the task model stays free of the verifier at import
    sources = [(self.final_tests, False), (self.initial_tests or "", False)] + [
      (data.decode("utf-8", "replace"), path.endswith(".sh"))
      for path, data in self.verifier_files if path.endswith((".py", ".sh"))]
    homes = {self.workdir or "/home/user", "/home/user"}   # a Harbor image's agent works in its WORKDIR
    return any(final_tests.runs_agent_code(source, home, shell) for source, shell in sources
               if source for home in homes)


def unsafe_task_names(tasks) -> list[str]:
  """The terminal tasks among ``tasks`` whose verdict the agent's code could decide (what a run
  that kept them on request names in its summary)."""
  from jaxes.envs.tasks import final_tests   # as tests_run_agent_code: no verifier at import
  return sorted({t.name for t in tasks if isinstance(t, Task) and final_tests.unsafe_verdict(t)})

"""``env.kind = "task_folders"``: train and evaluate on a downloaded suite of task folders
(Endless Terminals, Terminal-Bench / Harbor), run as their authors wrote them.

``env.task_dir`` holds the training split's folders, ``env.heldout_task_dir`` the held-out
split's (empty: the training folders). A folder whose verdict the agent's code could decide
(``final_tests.unsafe_verdict``) is refused at loading, one line naming it, unless
``env.allow_unsafe_verdicts`` (recorded in the run's config.json; summary.json names the kept
tasks) keeps it. ``env.task_build``: "docker" builds each folder's own
image (``jaxes.envs.images.task_images``; needs ``env.sandbox = "docker"``), "translate" translates it
into the shared sandbox image (a warning says so), "auto" is docker on the docker sandbox.
A split of n tasks from ``start`` takes the split's folders in name order, cycling.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from jaxes.envs import check as terminal_check
from jaxes.envs.tasks import loaders
from jaxes.errors import ConfigError

TASK_BUILDS = ("auto", "docker", "translate")


def task_build(config) -> str:
  """``env.task_build`` resolved: "docker" or "translate"."""
  build = config.env.task_build
  if build not in TASK_BUILDS:
    raise ConfigError(f"config.env.task_build: {build!r} is not one of {TASK_BUILDS}")
  if build == "auto":
    return "docker" if config.env.sandbox == "docker" else "translate"
  if build == "docker" and config.env.sandbox != "docker":
    raise ConfigError("config.env.task_build = 'docker' runs task-built images on the docker "
                      f"sandbox only; env.sandbox is {config.env.sandbox!r}")
  return build


@functools.lru_cache(maxsize=4)
def _load(directory: str, build: str, network: str = "none",
          allow_unsafe_verdicts: bool = False) -> tuple:
  # Once per folder and build per process: loading builds (or finds cached) each task's image.
  from jaxes.envs.images.task_images import TaskImageBuilder, TaskImageError
  try:
    builder = TaskImageBuilder(network=network) if build == "docker" else None
    return tuple(loaders.load_tasks(directory, builder=builder,
                                    allow_unsafe_verdicts=allow_unsafe_verdicts))
  except (loaders.TaskLoadError, TaskImageError) as err:
    raise ConfigError(f"config.env.task_dir: {err}") from err


@dataclasses.dataclass(frozen=True)
class TaskFolders:
  """Task folders from disk; everything but the tasks is the terminal environment's."""
  kind: str = "task_folders"
  check: Callable[[list[str] | None], int] = terminal_check.main

  @property
  def _terminal(self):
    from jaxes.envs.tasks.terminal_tasks import TerminalTasks
    return TerminalTasks()

  def make_tasks(self, config, split: str, n: int, start: int) -> list:
    directory = config.env.task_dir
    if split == "heldout" and config.env.heldout_task_dir:
      directory = config.env.heldout_task_dir
    if not directory:
      raise ConfigError("config.env.task_dir: empty; env.kind = 'task_folders' needs the folder "
                        "of a downloaded task suite")
    tasks = _load(directory, task_build(config), config.env.task_build_network,
                  bool(config.env.allow_unsafe_verdicts))
    return [dataclasses.replace(task, limits=dataclasses.replace(
              task.limits, max_turns=config.env.max_turns))
            for task in (tasks[(start + i) % len(tasks)] for i in range(n))]

  def default_system_prompt(self, config) -> str:
    return self._terminal.default_system_prompt(config)

  def tokenizer_texts(self, config) -> list[str]:
    return self._terminal.tokenizer_texts(config)

  def build_backend(self, config):
    task_build(config)   # a docker build on another sandbox stops here, in one line
    return self._terminal.build_backend(config)

  def make_episode(self, config, system_prompt: str) -> Callable[[Any, Any], Any]:
    return self._terminal.make_episode(config, system_prompt)

  def parses(self, config) -> Callable[[str], bool]:
    return self._terminal.parses(config)

  def oracle_transcripts(self, config, tasks: list, backend, make_episode) -> list[list[dict]]:
    return self._terminal.oracle_transcripts(config, tasks, backend, make_episode)

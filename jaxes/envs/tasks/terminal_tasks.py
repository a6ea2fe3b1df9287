"""The terminal-task environment (``env.kind = "terminal"``): procedurally generated shell tasks,
verified in a sandbox. Its own module, below the registry (``environments``), so that other kinds
built on it (``task_folders``) import it without importing the registry that imports them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxes.envs import check as terminal_check
from jaxes.envs import make_sandbox, protocol
from jaxes.envs.tasks import generator
from jaxes.envs.tasks import oracle

MakeEpisode = Callable[[Any, Any], Any]   # (task, backend handle) -> an episode of the protocol

# Text every terminal episode repeats, weighted up when a BPE tokenizer is built so its merges
# compress it.
_TERMINAL_TEXTS = ("<action>done</action>",
                   "Command executed successfully. Output: \n\n(exit_code=0)",
                   "Command failed. Output: \n\n(exit_code=1)")


@dataclasses.dataclass(frozen=True)
class TerminalTasks:
  """Procedurally generated shell tasks, verified in a sandbox (``env.sandbox``)."""
  kind: str = "terminal"
  check: Callable[[list[str] | None], int] = terminal_check.main

  def make_tasks(self, config, split: str, n: int, start: int) -> list:
    """Task i is family i mod F of the configured families at ``env.difficulty``, or cycling
    through 1..3 when it is 0."""
    families = task_families(config)
    tasks = []
    for i in range(start, start + n):
      difficulty = config.env.difficulty or generator.DIFFICULTIES[(i // len(families)) % 3]
      task = generator.generate(families[i % len(families)],
                                generator.split_seed(split, i, config.seed), difficulty)
      tasks.append(dataclasses.replace(
          task, limits=dataclasses.replace(task.limits, max_turns=config.env.max_turns)))
    return tasks

  def default_system_prompt(self, config) -> str:
    return action_format(config).system_prompt

  def tokenizer_texts(self, config) -> list[str]:
    return [action_format(config).parse_error_observation, *_TERMINAL_TEXTS]

  def build_backend(self, config):
    return make_sandbox(config.env.sandbox)

  def make_episode(self, config, system_prompt: str) -> MakeEpisode:
    def make_terminal_episode(task, handle):
      # On the deterministic schedule the episode limit counts sandbox time only: decoding time
      # follows the machine's load and the process layout, and would end episodes differently.
      return protocol.Episode(task, handle, partial_credit=config.env.partial_credit,
                              parse_error_penalty=config.env.parse_error_penalty,
                              system_prompt=system_prompt, action_format=action_format(config),
                              model_time_counts=config.rollout.sandbox_steps == 0)
    return make_terminal_episode

  def parses(self, config) -> Callable[[str], bool]:
    parse = action_format(config).parse
    return lambda text: parse(text).kind != "invalid"

  def oracle_transcripts(self, config, tasks: list, backend, make_episode: MakeEpisode) -> list[list[dict]]:
    return oracle.oracle_transcripts(tasks, backend, make_episode, config.env.sandbox_workers)


def action_format(config) -> protocol.ActionFormat:
  """How replies write their action (``env.action_format``: "tags" or "fenced")."""
  return protocol.ACTION_FORMATS[config.env.action_format]


def task_families(config) -> list[str]:
  """The terminal task families ``env.families`` names (all when empty)."""
  return [f.strip() for f in config.env.families.split(",") if f.strip()] or list(generator.FAMILIES)

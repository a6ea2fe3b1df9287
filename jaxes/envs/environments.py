"""The environment registry: ``env.kind`` -> the object that makes a kind of environment's parts.

An environment kind builds a split's tasks (terminal tasks, WebShop goals), the backend episodes
run against (a sandbox, the in-process WebShop), the agent protocol's episode for a task, the
warm start's oracle transcripts, the texts a run's tokenizer is built to compress, and names its
oracle checker. ``builders`` asks the registry and nothing else, so a new kind is one class here
(or registered from its own module with ``register``) plus its config block, and no builder or
trainer changes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from jaxes.envs import webshop
from jaxes.envs.tasks.task_folders import TaskFolders
from jaxes.envs.tasks.terminal_tasks import MakeEpisode, TerminalTasks, task_families
from jaxes.envs.webshop import check as webshop_check
from jaxes.errors import ConfigError

__all__ = ["ENVIRONMENTS", "Environment", "TaskFolders", "TerminalTasks", "WebShop", "environment",
           "register", "task_families"]


class Environment(Protocol):
  """What a run needs from a kind of environment."""
  kind: str
  # The oracle checker's command line: ``check(argv) -> exit status`` (``python -m jaxes.envs.check``).
  check: Callable[[list[str] | None], int]

  def make_tasks(self, config, split: str, n: int, start: int) -> list:
    """Tasks ``start .. start + n - 1`` of ``split`` ("train", "heldout")."""

  def default_system_prompt(self, config) -> str:
    """The system prompt when ``env.system_prompt`` is empty."""

  def tokenizer_texts(self, config) -> list[str]:
    """The protocol's fixed texts, repeated in every episode."""

  def build_backend(self, config):
    """What episodes run against (``EpisodeRunner``'s sandbox)."""

  def make_episode(self, config, system_prompt: str) -> MakeEpisode:
    """The agent protocol with the config's reward settings."""

  def parses(self, config) -> Callable[[str], bool]:
    """Whether a model reply names an action the protocol accepts (the format rate's test)."""

  def oracle_transcripts(self, config, tasks: list, backend, make_episode: MakeEpisode) -> list[list[dict]]:
    """The warm start's oracle transcripts of ``tasks`` (passing episodes only)."""


@dataclasses.dataclass(frozen=True)
class WebShop:
  """WebShop goals (generated, or the released ones at ``webshop.data_path``), in process."""
  kind: str = "webshop"
  check: Callable[[list[str] | None], int] = webshop_check.main

  def make_tasks(self, config, split: str, n: int, start: int) -> list:
    w = config.webshop
    return webshop.make_goals(split, n, config.seed, start, data_path=w.data_path,
                              num_products=w.num_products, catalog_seed=w.catalog_seed,
                              human_goals=w.human_goals, max_steps=w.max_steps,
                              results_per_page=w.results_per_page, asin_length=w.asin_length)

  def default_system_prompt(self, config) -> str:
    return webshop.SYSTEM_PROMPT.format(max_steps=config.webshop.max_steps)

  def tokenizer_texts(self, config) -> list[str]:
    return list(webshop.tokenizer_texts(config.webshop.max_steps))

  def build_backend(self, config):
    return webshop.WebShopBackend()

  def make_episode(self, config, system_prompt: str) -> MakeEpisode:
    def make_webshop_episode(goal, handle):
      return webshop.WebShopEpisode(goal, handle, max_steps=config.webshop.max_steps,
                                    system_prompt=system_prompt,
                                    parse_error_penalty=config.env.parse_error_penalty)
    return make_webshop_episode

  def parses(self, config) -> Callable[[str], bool]:
    return lambda text: webshop.env.parse_action(text) is not None

  def oracle_transcripts(self, config, tasks: list, backend, make_episode: MakeEpisode) -> list[list[dict]]:
    out = [webshop.transcript(g, backend, make_episode, config.webshop.max_steps) for g in tasks]
    return webshop.off_protocol([m for m in out if m is not None], config.webshop.off_protocol_fraction,
                                config.seed)


ENVIRONMENTS: dict[str, Environment] = {}


def register(environment: Environment) -> Environment:
  """Adds a kind (``env.kind = environment.kind`` then selects it); a kind is registered once."""
  if environment.kind in ENVIRONMENTS:
    raise ValueError(f"environment kind {environment.kind!r} is registered already")
  ENVIRONMENTS[environment.kind] = environment
  return environment


register(TerminalTasks())
register(WebShop())
register(TaskFolders())


def environment(config) -> Environment:
  """The registered environment of ``config.env.kind``."""
  kind = config.env.kind
  if kind not in ENVIRONMENTS:
    raise ConfigError(f"config.env.kind: {kind!r} is not one of {sorted(ENVIRONMENTS)}")
  return ENVIRONMENTS[kind]


"""Parameter–context co-evolution (Agentic ESOpt) in the trainer: ``coevolve.enabled``.

A population member is (noise key, context). ``jaxes.controller.coevolve`` decides each member's
context from the seed, the version and that version's parents; this module is the trainer's
side of it:

* the library of prompt pieces from the config (``coevolve.pieces``, one per line; empty: the
  terminal-task pieces below);
* a member's system prompt: the run's system prompt, then its context's pieces, one per line
  (the empty context is the run's prompt as it is);
* ``ContextEpisodes``: each training or evaluation spec with its member's episode protocol, and
  the check, once the tokenizer exists, that every piece survives tokenization and that the
  longest context leaves room for a turn in the cache row;
* ``after_update``: the best contexts of an update's cohort become the next version's parents.

The ``Coevolution`` object lives in the run state (``RunState.contexts``); checkpoints and the
update log carry its ``state_dict``, so a resumed run hands out the same contexts.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxes import tokenization
from jaxes.controller.coevolve import Coevolution, ContextLibrary
from jaxes.envs import environments
from jaxes.errors import ConfigError, OptionError
from jaxes.rollout.episodes import EpisodeSpec

# Short advice for shell tasks: each is a few tokens of the demo tokenizer's vocabulary (which
# is built from them too, ``pieces``), so a context costs little of the cache row.
DEFAULT_PIECES = (
    "Run one command per turn.",
    "Look at the files before you change them.",
    "Use the exact paths the task names.",
    "Check the result before you finish.",
    "Keep each command short.",
)


def pieces(config) -> tuple[str, ...]:
  """The library's pieces of a run that co-evolves contexts; () for one that does not."""
  if not config.coevolve.enabled:
    return ()
  given = tuple(p.strip() for p in config.coevolve.pieces.splitlines() if p.strip())
  return given or DEFAULT_PIECES


def from_config(config) -> Coevolution | None:
  """A fresh run's co-evolution state (version 0's parent: the empty context), or None when
  ``coevolve.enabled`` is off. Errors (``OptionError``) name the ``coevolve`` key they reject."""
  co = config.coevolve
  if not co.enabled:
    return None
  if config.train.algorithm != "es":
    raise OptionError("enabled", f"co-evolves ES members' contexts; train.algorithm is "
                                 f"{config.train.algorithm!r}")
  if co.max_pieces < 1:
    raise OptionError("max_pieces", f"must be >= 1, got {co.max_pieces}")
  if co.parents < 1:
    raise OptionError("parents", f"must be >= 1, got {co.parents}")
  library = ContextLibrary(pieces(config), max_pieces=co.max_pieces)
  return Coevolution(library, seed=config.seed, parents=co.parents)


def restored(config, state: dict | None) -> Coevolution | None:
  """The co-evolution state a checkpoint or update-log record stored (``state``), under the
  config's library; None when the run does not co-evolve. A co-evolving run whose checkpoint
  has no contexts is refused (it was written by a run without them)."""
  fresh = from_config(config)
  if fresh is None:
    return None
  if state is None:
    raise ConfigError("config.coevolve.enabled: the checkpoint holds no contexts (its run did "
                      "not co-evolve them); turn it off, or start fresh")
  try:
    return Coevolution.from_state_dict(fresh.library, state)
  except ValueError as err:
    raise ConfigError(f"config.coevolve.pieces: {err}") from None


def after_update(contexts: Coevolution | None, version: int, results: Sequence, keep: set[int]) -> dict:
  """After the update that made ``version`` from ``results`` (version, member, fitness, ...):
  the parents of ``version``, from the cohort's best pairs; parents of versions no job can use
  any more (older than every version in ``keep``) are forgotten. Returns what the metrics line
  records (the parents, as piece indices), {} without co-evolution."""
  if contexts is None:
    return {}
  parents = contexts.update(version - 1, [(int(r[0]), int(r[1]), float(r[2])) for r in results])
  contexts.forget(min(keep | {version}))
  return {"context_parents": [list(c) for c in parents]}


@dataclasses.dataclass
class ContextEpisodes:
  """Specs with their member's system prompt. One protocol factory per distinct prompt (the
  environment's ``make_episode``), built on first use."""
  config: object
  base_prompt: str

  def __post_init__(self):
    self._factories: dict[str, object] = {}

  def prompt(self, contexts: Coevolution, version: int, member: int) -> str:
    text = contexts.prompt(version, member)
    return f"{self.base_prompt}\n{text}" if text else self.base_prompt

  def spec(self, spec: EpisodeSpec, contexts: Coevolution | None) -> EpisodeSpec:
    """``spec`` as it is without co-evolution; else with the protocol of its member's context
    (evaluation's member -1: the best context so far)."""
    if contexts is None:
      return spec
    prompt = self.prompt(contexts, spec.version, spec.member)
    if prompt not in self._factories:
      self._factories[prompt] = environments.environment(self.config).make_episode(self.config, prompt)
    return dataclasses.replace(spec, make_episode=self._factories[prompt])

  def check(self, contexts: Coevolution | None, tokenizer) -> None:
    """A one-line ConfigError for a library the run's tokenizer cannot carry: a piece that does
    not decode back to itself, or a longest context that leaves no room for a turn."""
    if contexts is None:
      return
    library = contexts.library
    for piece in library.pieces:
      ids = tokenizer.encode(piece, add_special_tokens=False)
      if tokenizer.decode(ids) != piece:
        raise ConfigError(f"config.coevolve.pieces: {piece!r} does not survive the run's tokenizer "
                          f"(decodes to {tokenizer.decode(ids)!r})")
    longest = sorted(range(len(library.pieces)), key=lambda i: -len(library.pieces[i]))[:library.max_pieces]
    text = f"{self.base_prompt}\n{library.render(tuple(longest))}"
    used = len(tokenizer.encode(tokenization.chat_prompt([{"role": "system", "content": text}]),
                                add_special_tokens=False))
    r = self.config.rollout
    if used + r.max_new_tokens >= r.max_len:
      raise ConfigError(f"config.coevolve.pieces: the longest context's system prompt is {used} "
                        f"tokens, which leaves no room for a {r.max_new_tokens}-token turn in "
                        f"config.rollout.max_len = {r.max_len}")

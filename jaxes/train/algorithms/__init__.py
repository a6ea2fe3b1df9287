"""The training algorithms one ``Trainer`` runs, by ``train.algorithm``.

Adding an algorithm is a module here (a ``base.Capabilities`` subclass writing ``base.Algorithm``'s
seven-member core and overriding only the optional capabilities it uses), its config block and
one entry in ``ALGORITHMS``; the trainer, run state, checkpoints and update log are shared.
"""
from __future__ import annotations

from jaxes.train.algorithms import evolution, grpo, sao
from jaxes.train.algorithms.base import (Algorithm, Capabilities, ReplaysUpdates, TrainEpisode,
                                         UpdateContext, Updated)
from jaxes.errors import ConfigError

ALGORITHMS = {"es": evolution.EvolutionStrategies, "grpo": grpo.GRPO, "sao": sao.SAO}

__all__ = ["ALGORITHMS", "Algorithm", "Capabilities", "ReplaysUpdates", "TrainEpisode", "UpdateContext",
           "Updated", "build", "checkpoint_item", "controller_config"]


def _class(name: str):
  if name not in ALGORITHMS:
    raise ConfigError(f"config.train.algorithm: {name!r} is not one of {sorted(ALGORITHMS)}")
  return ALGORITHMS[name]


def build(config, parts, mesh, settings=None) -> Algorithm:
  """The configured algorithm for a run's ``parts`` (``state.Parts``) on ``mesh``; ``settings``:
  its config block as ``config.validate`` built it (``RunSpec.algorithm_settings``; None: built
  here)."""
  return _class(config.train.algorithm)(config, parts, mesh, settings)


def controller_config(config):
  """The controller configuration of the configured algorithm (what a member is)."""
  return _class(config.train.algorithm).controller_config_of(config)


def checkpoint_item(name: str) -> str:
  """The checkpoint item holding algorithm ``name``'s state (and so its parameters)."""
  return _class(name).checkpoint_item

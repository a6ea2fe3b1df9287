"""Errors a run reports as one line (``python -m jaxes.train`` prints them without a traceback)."""
from __future__ import annotations

import contextlib


class ConfigError(ValueError):
  """A config value is invalid; the message starts with the key, e.g. ``config.es.sigma``."""


class OptionError(ValueError):
  """A typed object (``es.Strategy``, ``ControllerConfig``, ``Qwen2Config``, ...) rejects one of its
  options. ``option`` is the field's name and ``reason`` says why, so a config key can be named
  from the object's error without reading its message (``keyed``)."""

  def __init__(self, option: str, reason: str, message: str | None = None):
    super().__init__(message or f"{option} {reason}")
    self.option, self.reason = option, reason


@contextlib.contextmanager
def keyed(config, section: str, *more: str):
  """Turns the errors of typed objects built from ``config.<section>`` (and the ``more``
  sections) into ``ConfigError``s naming the key: ``config.es.population: must be even ...`` in
  the first section that has the option, else ``config.<section>: <message>``. A
  ``ConfigError`` (already keyed) passes unchanged."""
  try:
    yield
  except ConfigError:
    raise
  except OptionError as err:
    for name in (section, *more):
      if err.option in config[name]:
        raise ConfigError(f"config.{name}.{err.option}: {err.reason}") from err
    raise ConfigError(f"config.{section}: {err}") from err
  except ValueError as err:
    raise ConfigError(f"config.{section}: {err}") from err


class RunStateError(RuntimeError):
  """The run directory cannot be continued with this config (one line, says what to do)."""

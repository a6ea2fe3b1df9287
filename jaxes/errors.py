"""Errors a run reports as one line (``python -m jaxes.train`` prints them without a traceback)."""


class ConfigError(ValueError):
  """A config value is invalid; the message starts with the key, e.g. ``config.es.sigma``."""


class RunStateError(RuntimeError):
  """The run directory cannot be continued with this config (one line, says what to do)."""

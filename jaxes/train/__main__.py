"""``python -m jaxes.train --config=configs/demo.py --workdir=runs/demo [--config.x.y=...] [--restart]``

Validates the config (errors name the key) before any compute, then trains; rerunning the same
command resumes from the newest checkpoint in ``--workdir``. ``--restart`` sets the directory's
previous run aside (every file in it moved into ``WORKDIR/restarted-<time>/``, nothing deleted;
the compile cache stays) and starts fresh. A directory holding another command's files (an
exported model's ``config.json``) is refused unless ``--restart``, which moves them aside too.
A rerun whose config differs from the run's (beyond ``config_history.FREE_KEYS``) stops unless
``--allow_config_change``, which records the change in ``WORKDIR/config_history.json``. The run's
summary goes to ``WORKDIR/summary.json`` (also printed with ``--verbose``).
A bad config, a missing config file or a run directory that cannot be continued is one line on
stderr and exit status 2. ``--config_help`` lists every config key with its default (or, with
``--config=FILE``, that config's value).
"""
from __future__ import annotations

import json
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxes import cli
from jaxes.train import run_dir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml-collections config file "
                                          "(configs/*.py; add :ARG for configs taking one).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots.")
_RESTART = flags.DEFINE_bool("restart", False, "Set the directory's previous run aside and start fresh.")
_ALLOW_CHANGE = flags.DEFINE_bool("allow_config_change", False, "Resume with a config that differs from "
                                  "the run's; the change is recorded in WORKDIR/config_history.json.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print the run's summary (summary.json) as JSON at the end.")
flags.DEFINE_bool("config_help", False, "List every config key (--config.KEY=VALUE) with its "
                  "default, or with --config=FILE that config's value, and exit.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(message: str) -> None:
  cli.usage_error("error", message)


def _config_help(argv) -> None:
  """``--config_help``: every config key, flat, with the given config's value or the default."""
  from jaxes.train import defaults
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  if spec:
    config = _parse_flags([a for a in argv if a != "--config_help"] + ["--workdir=."], help_ok=False)
  else:
    config = defaults.base_config()
  print(f"config keys ({spec or 'jaxes/train/defaults.py'}); set one with --config.KEY=VALUE:")
  for key, value in defaults.flat_keys(config).items():
    print(f"  {key.removeprefix('config.')} = {value!r}")
  sys.exit(0)


def _parse_flags(argv, help_ok: bool = True):
  """absl's flag parsing, with a missing config file, an unknown ``--config.KEY`` or a failing
  ``get_config`` reported as one line instead of ml_collections' traceback; ``--help`` exits 0
  (absl's exits 1) and points to ``--config_help``. Returns the config (``help_ok=False``)."""
  if help_ok and "--config_help" in argv:
    _config_help(argv)
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  if spec and not os.path.isfile(spec.split(":", 1)[0]):
    _fail(f"--config={spec}: no such config file")
  try:
    rest = flags.FLAGS(argv)
    return rest if help_ok else _CONFIG.value
  except SystemExit:   # absl's help flags print the usage, then exit 1
    if not cli.wants_help(argv):
      raise
    print("\nconfig keys and their defaults: python -m jaxes.train --config_help "
          "[--config=FILE]")
    sys.exit(0)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    from jaxes.train import defaults
    text = str(e)
    if isinstance(e, (AttributeError, KeyError)):   # an override names a key the config lacks
      missing = (re.findall(r"\w+", text.split("Did you mean")[0]) or [""])[0]
      for key in (a[2:].split("=", 1)[0] for a in argv if a.startswith("--config.")):
        if missing in key.split(".")[1:]:
          hint = re.search(r'Did you mean "(\w+)"', text)
          _fail(f"{key}: unknown key" + (f" (did you mean {hint.group(1)!r}?)" if hint else
                                         defaults.did_you_mean(key)))
    last = [line.strip() for line in text.splitlines() if line.strip()]
    _fail(last[-1] if last else type(e).__name__)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # jaxes (and so JAX) is imported only after the flags parsed: a bad command line fails at once.
  cli.start_jax(init_backends=False)   # JAX_PLATFORMS=cpu where no accelerator is; no plugin noise
  from jaxes import distributed
  distributed.initialize()   # a multi-process launch joins here; a single process: nothing
  cli.start_backends()
  from jaxes.errors import ConfigError
  from jaxes.run_tools import report   # the command composes the layers: the trainer gets its page writer
  from jaxes.train.trainer import Trainer   # runs the algorithm config.train.algorithm names
  try:   # the trainer validates the config (and writes nothing until it runs)
    trainer = Trainer(_CONFIG.value, _WORKDIR.value, allow_config_change=_ALLOW_CHANGE.value,
                      write_report=report.write)
  except ConfigError as e:
    _fail(f"invalid config: {e}")
  if os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
    _fail(f"--workdir={_WORKDIR.value}: is a file, not a directory")
  try:
    os.makedirs(_WORKDIR.value, exist_ok=True)
  except OSError as e:   # a parent is a file, or not writable
    _fail(f"--workdir={_WORKDIR.value}: cannot create it ({e.strerror})")
  if (why := run_dir.unwritable(_WORKDIR.value)) is not None:
    _fail(f"--workdir={_WORKDIR.value}: cannot write in it ({why})")
  if not _RESTART.value and (why := run_dir.foreign_config(_WORKDIR.value)):
    _fail(f"--workdir={_WORKDIR.value}: {why}; nothing was written. Use another --workdir, or "
          f"--restart to move what is there aside")
  if _RESTART.value and (aside := run_dir.restart(_WORKDIR.value)):
    print(f"--restart: every file of the previous run in {_WORKDIR.value} was moved to {aside}",
          file=sys.stderr)
  if cli.platform_note and distributed.is_primary():
    print(cli.platform_note, file=sys.stderr)
  from jaxes.train.policy import PolicyLoadError
  from jaxes.train.state import RunStateError
  from jaxes.envs.sandboxes.sandbox import SandboxError
  try:
    summary = trainer.run()
  except (RunStateError, PolicyLoadError, ConfigError, SandboxError) as e:
    _fail(str(e))
  if not distributed.is_primary() or not _VERBOSE.value:
    return   # the before/after table stays the last thing on the screen; the rest is in summary.json
  # Per-task outcomes stay in summary.json and metrics.jsonl; the terminal gets the totals.
  brief = {k: ({kk: vv for kk, vv in v.items() if not kk.startswith("per_task")}
               if isinstance(v, dict) else v)
           for k, v in summary.items() if k != "params"}
  print(json.dumps(brief, indent=2, default=str))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)

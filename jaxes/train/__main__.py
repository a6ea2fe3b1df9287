"""``python -m jaxes.train --config=configs/demo.py --workdir=runs/demo [--config.x.y=...] [--restart]``

Validates the config (errors name the key) before any compute, then trains; rerunning the same
command resumes from the newest checkpoint in ``--workdir``. ``--restart`` sets the directory's
previous run aside (moved into ``WORKDIR/restarted-<time>/``, nothing deleted) and starts fresh.
A rerun whose config differs from the run's (beyond ``config_history.FREE_KEYS``) stops unless
``--allow_config_change``, which records the change in ``WORKDIR/config_history.json``. The run's
summary goes to ``WORKDIR/summary.json`` (also printed with ``--verbose``).
A bad config, a missing config file or a run directory that cannot be continued is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml-collections config file "
                                          "(configs/*.py; add :ARG for configs taking one).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots.")
_RESTART = flags.DEFINE_bool("restart", False, "Set the directory's previous run aside and start fresh.")
_ALLOW_CHANGE = flags.DEFINE_bool("allow_config_change", False, "Resume with a config that differs from "
                                  "the run's; the change is recorded in WORKDIR/config_history.json.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print the run's summary (summary.json) as JSON at the end.")
flags.mark_flags_as_required(["config", "workdir"])

# What a run directory holds; --restart moves these aside.
RUN_FILES = ("checkpoints", "checkpoints_superseded", "update_log", "metrics.jsonl", "tensorboard",
             "summary.json", "progress.png", "tokenizer", "config.json", "config_history.json")


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  """absl's flag parsing, with a missing config file, an unknown ``--config.KEY`` or a failing
  ``get_config`` reported as one line instead of ml_collections' traceback."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  if spec and not os.path.isfile(spec.split(":", 1)[0]):
    _fail(f"--config={spec}: no such config file")
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    text = str(e)
    if isinstance(e, (AttributeError, KeyError)):   # an override names a key the config lacks
      missing = (re.findall(r"\w+", text.split("Did you mean")[0]) or [""])[0]
      for key in (a[2:].split("=", 1)[0] for a in argv if a.startswith("--config.")):
        if missing in key.split(".")[1:]:
          hint = re.search(r'Did you mean "(\w+)"', text)
          _fail(f"{key}: unknown key" + (f" (did you mean {hint.group(1)!r}?)" if hint else ""))
    last = [line.strip() for line in text.splitlines() if line.strip()]
    _fail(last[-1] if last else type(e).__name__)


def restart(workdir: str) -> str | None:
  """Moves the previous run's files into ``workdir/restarted-<UTC time>/``; returns that path."""
  present = [n for n in os.listdir(workdir) if n in RUN_FILES or n.startswith("update_log.")]
  if not present:
    return None
  aside = os.path.join(workdir, time.strftime("restarted-%Y%m%dT%H%M%SZ", time.gmtime()))
  os.makedirs(aside)
  for name in present:
    os.rename(os.path.join(workdir, name), os.path.join(aside, name))
  return aside


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # jaxes (and so JAX) is imported only after the flags parsed: a bad command line fails at once.
  from jaxes import distributed
  distributed.initialize()   # a multi-process launch joins here; a single process: nothing
  from jaxes.train.errors import ConfigError
  from jaxes.train.config import validate
  config = _CONFIG.value
  try:
    validate(config)
  except ConfigError as e:
    _fail(f"invalid config: {e}")
  if os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
    _fail(f"--workdir={_WORKDIR.value}: is a file, not a directory")
  try:
    os.makedirs(_WORKDIR.value, exist_ok=True)
  except OSError as e:   # a parent is a file, or not writable
    _fail(f"--workdir={_WORKDIR.value}: cannot create it ({e.strerror})")
  if _RESTART.value and (aside := restart(_WORKDIR.value)):
    print(f"--restart: the previous run in {_WORKDIR.value} was moved to {aside}", file=sys.stderr)
  from jaxes.train.policy import PolicyLoadError
  from jaxes.train.state import RunStateError
  from jaxes.envs.sandbox import SandboxError
  from jaxes.train.trainer import Trainer   # runs the algorithm config.train.algorithm names
  try:
    summary = Trainer(config, _WORKDIR.value, allow_config_change=_ALLOW_CHANGE.value).run()
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

"""``python -m jaxes.train --config=configs/demo.py --workdir=runs/demo [--config.x.y=...]``

Validates the config (errors name the key) before any compute, then trains; rerunning the same
command resumes from the newest checkpoint in ``--workdir``.
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml-collections config file "
                                          "(configs/*.py; add :ARG for configs taking one).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from jaxes.train.config import ConfigError, validate
  config = _CONFIG.value
  try:
    validate(config)
  except ConfigError as e:
    print(f"invalid config: {e}", file=sys.stderr)
    sys.exit(2)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  from jaxes.train.trainer import Trainer
  summary = Trainer(config, _WORKDIR.value).run()
  # Per-task outcomes stay in summary.json and metrics.jsonl; the terminal gets the totals.
  brief = {k: ({kk: vv for kk, vv in v.items() if kk != "per_task"} if isinstance(v, dict) else v)
           for k, v in summary.items() if k != "params"}
  print(json.dumps(brief, indent=2, default=str))


if __name__ == "__main__":
  app.run(main)

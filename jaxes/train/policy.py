"""A trained run's policy, loaded from its run directory: ``load_policy(workdir, version=None)``.

Reads only what a policy is: the run's config (stored in every checkpoint), its tokenizer and
the parameters of one checkpointed version (default: the newest readable one; a corrupt newest
step is skipped with a warning, as training does), restored against abstract shapes (no optimizer
state, no old versions, nothing allocated twice). Benchmarks, ``warmstart.init_from`` and
``python -m jaxes.run_tools.export`` all load runs this way.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from flax import nnx
from ml_collections import config_dict

from jaxes.models import qwen2
from jaxes.train import algorithms, builders, checkpoint, config_history, defaults


class PolicyLoadError(RuntimeError):
  """The run directory holds no loadable policy (one line: which directory, what is missing)."""


@dataclasses.dataclass(frozen=True)
class Policy:
  config: config_dict.ConfigDict   # the run's config, as its checkpoint recorded it (``defaults.completed``)
  tokenizer: Any
  model_config: qwen2.Qwen2Config
  graphdef: nnx.GraphDef
  params: nnx.State
  version: int
  # config_history entries that apply to the updates up to this version (config changes on resume)
  config_changes: list = dataclasses.field(default_factory=list)


def load_policy(workdir: str, version: int | None = None) -> Policy:
  """The policy of checkpointed ``version`` (default: the newest) of the run in ``workdir``."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise PolicyLoadError(f"{workdir}: not a run directory (no checkpoints/ in it)")
  ckpt = checkpoint.Checkpointer(directory)
  try:
    steps = ckpt.steps()
    if not steps:
      raise PolicyLoadError(f"{workdir}: the run has no checkpoint yet")
    if version is not None and int(version) not in steps:
      raise PolicyLoadError(f"{workdir}: no checkpoint of version {version}; checkpointed versions: {steps}")
    # The newest readable step, as training resumes; an explicit version is that step or an error.
    for step in reversed(steps) if version is None else [int(version)]:
      try:
        return _load_step(ckpt, workdir, step)
      except checkpoint.CorruptCheckpoint as e:
        if version is not None or step == steps[0]:
          raise PolicyLoadError(f"{workdir}: {e}") from None
        warnings.warn(f"{e}; loading the previous step (nothing moved or deleted)", RuntimeWarning,
                      stacklevel=2)
  finally:
    ckpt.close()


def _load_step(ckpt: checkpoint.Checkpointer, workdir: str, step: int) -> Policy:
  config = defaults.completed(ckpt.restore_host(step)["config"])   # the config in force at step
  tokenizer_path = builders.tokenizer_dir(config, workdir)
  if tokenizer_path is None:
    raise PolicyLoadError(f"{workdir}: the run's tokenizer is missing (expected {workdir}/tokenizer)")
  tokenizer = builders.load_tokenizer(tokenizer_path)
  model = builders.build_model(config, len(tokenizer))
  item = algorithms.checkpoint_item(config.train.algorithm)
  params = ckpt.restore_item(step, item, {"params": model.abstract_params}, partial=True)["params"]
  changes = [e for e in config_history.history(workdir) if e["since_version"] < step]
  return Policy(config, tokenizer, model.config, model.graphdef, params, step, changes)

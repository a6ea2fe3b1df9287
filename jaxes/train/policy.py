"""A trained run's policy, loaded from its run directory: ``load_policy(workdir, version=None)``.

Reads only what a policy is: the run's config (stored in every checkpoint), its tokenizer and
the parameters of one checkpointed version, restored against abstract shapes (no optimizer
state, no old versions, nothing allocated twice). Benchmarks, ``warmstart.init_from`` and
``python -m jaxes.train.export`` all load runs this way.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx
from ml_collections import config_dict

from jaxes.models import qwen2
from jaxes.train import builders, checkpoint


class PolicyLoadError(RuntimeError):
  """The run directory holds no loadable policy (one line: which directory, what is missing)."""


@dataclasses.dataclass(frozen=True)
class Policy:
  config: config_dict.ConfigDict   # the run's config, as its checkpoint recorded it
  tokenizer: Any
  model_config: qwen2.Qwen2Config
  graphdef: nnx.GraphDef
  params: nnx.State
  version: int


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
    step = steps[-1] if version is None else int(version)
    if step not in steps:
      raise PolicyLoadError(f"{workdir}: no checkpoint of version {step}; checkpointed versions: {steps}")
    config = config_dict.ConfigDict(ckpt.restore_host(step)["config"])
    tokenizer_path = builders.tokenizer_dir(config, workdir)
    if tokenizer_path is None:
      raise PolicyLoadError(f"{workdir}: the run's tokenizer is missing (expected {workdir}/tokenizer)")
    tokenizer = builders.load_tokenizer(tokenizer_path)
    model = builders.build_model(config, len(tokenizer))
    item = "learner" if config.train.get("algorithm", "es") == "grpo" else "es"  # (grpo_trainer)
    params = ckpt.restore_item(step, item, {"params": model.abstract_params}, partial=True)["params"]
  finally:
    ckpt.close()
  return Policy(config, tokenizer, model.config, model.graphdef, params, step)

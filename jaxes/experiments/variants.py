"""What a grid variant is: a name mapped to a config (``FILE:ARG`` or ``FILE`` plus overrides)
and the module that trains it (``python -m ENTRY --config=... --workdir=...``).

A config file that defines ``VARIANTS`` (configs/paper.py, configs/demo_grid.py) names its own
variants and ``get_config(variant)`` builds each (``python -m jaxes.train`` trains ES and GRPO
variants alike: it dispatches on ``train.algorithm``); ``VARIANT_ENTRY_POINTS`` maps any trained
by another entry point. A config without ``VARIANTS`` (configs/demo.py) gets the paper's ES
variants as override sets (``ES_OVERRIDES``). Anything else -- ``grpo`` for a config that defines
no GRPO variant -- is *not available*, with the reason, and the grid reports it as such instead
of running something else under its name.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

DEFAULT_ENTRY = "jaxes.train"

_ASYNC1 = {"controller.mode": "async", "controller.max_staleness": 1,
           "controller.delay_fraction": 0.0, "controller.delay_updates": 0,
           "controller.stress_all_stale": 0, "controller.overage": "drop",
           "rollout.switch_versions": False}
# The paper's ES variants (configs/paper.py's definitions), as overrides for any config.
ES_OVERRIDES = {
    "sync": {**_ASYNC1, "controller.mode": "sync", "controller.max_staleness": 0},
    "async1": _ASYNC1,
    "delay4": {**_ASYNC1, "controller.delay_fraction": 0.1, "controller.delay_updates": 4},
    "delay8": {**_ASYNC1, "controller.delay_fraction": 0.1, "controller.delay_updates": 8},
    "allstale": {**_ASYNC1, "controller.stress_all_stale": 4},
    # The stale-result policies (jaxes/controller/policies.py) on Async-1.
    "async1_weight": {**_ASYNC1, "controller.overage": "weight", "controller.staleness_decay": 0.5},
    "async1_baseline_only": {**_ASYNC1, "controller.overage": "baseline_only"},
    "async1_pace": {**_ASYNC1, "controller.overage": "pace", "controller.pace_pool_capacity": 0,
                    "controller.pace_generation_weight": 1.0},
    # Slow issuing instead of discarding (tinker's async RL): bound K = 2, work issued one
    # update ahead, stragglers waited for (nothing dropped).
    "async2_throttle": {**_ASYNC1, "controller.max_staleness": 2, "controller.overage": "throttle",
                        "controller.issue_depth": 1},
    # Parameter-context co-evolution (jaxes/train/coevolution.py) on Async-1: paired with async1,
    # the difference is the evolving system prompt's.
    "coevolve": {**_ASYNC1, "coevolve.enabled": True},
    # In-flight version change (PipelineRL's, docs/controller.md) on Async-1: an episode's next
    # turn decodes under the newest weights with its member's noise.
    "async1_switch": {**_ASYNC1, "rollout.switch_versions": True},
    # Antithetic pairs kept together (issue 63): a result waits, within K, for its partner.
    "async1_pairs": {**_ASYNC1, "controller.pairs": "together"},
}


def apply_es_variant(config, name: str):
  """Sets ``config``'s controller keys to the paper's ES variant ``name`` (the one definition of
  the variants; configs/paper.py and configs/demo_grid.py use it too); returns ``config``."""
  for key, value in ES_OVERRIDES[name].items():
    section, field = key.split(".")
    config[section][field] = value
  return config


# What each variant means, for tables.
DESCRIPTIONS = {
    "sync": "synchronous ES",
    "async1": "Async-1 (natural asynchrony, staleness <= 1)",
    "delay4": "10% of each cohort delayed 4 updates",
    "delay8": "10% of each cohort delayed 8 updates",
    "allstale": "stress: every result of a cohort delayed 4 updates",
    "async1_weight": "Async-1, results weighted 0.5 ** staleness",
    "async1_baseline_only": "Async-1, stale results only in the shaping baseline",
    "async1_pace": "Async-1, PACE (pool rejection budget, effective-staleness ranking)",
    "async2_throttle": "staleness <= 2, work issued one update ahead, stragglers waited for (tinker)",
    "coevolve": "Async-1, system prompts co-evolved with the parameters (Agentic ESOpt)",
    "async1_switch": "Async-1, later turns decoded under the newest weights (PipelineRL)",
    "async1_pairs": "Async-1, a result waits (within the bound) for its antithetic partner",
    "grpo": "GRPO (backprop baseline)",
}


class GridError(ValueError):
  """A grid that cannot be planned (bad variant list, config file, override): one line."""


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  config_spec: str            # what --config= gets: FILE or FILE:ARG
  overrides: dict             # config key (without "config.") -> value, before the user's
  entry: str = DEFAULT_ENTRY  # python -m ENTRY
  unavailable: str = ""       # non-empty: why this variant cannot run

  @property
  def available(self) -> bool:
    return not self.unavailable

  def override_flags(self) -> list[str]:
    return [f"--config.{k}={v}" for k, v in self.overrides.items()]


def load_module(config_path: str):
  if not os.path.isfile(config_path):
    raise GridError(f"--config={config_path}: no such config file")
  spec = importlib.util.spec_from_file_location(
      "grid_config_" + os.path.splitext(os.path.basename(config_path))[0], config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def resolve(config: str, name: str, module=None) -> Variant:
  """The variant ``name`` of ``config`` (``FILE``, or ``FILE:{variant},ARGS`` where a config takes
  more than the variant, e.g. ``configs/paper.py:{variant},v5p-64``)."""
  path, _, arg = config.partition(":")
  module = module or load_module(path)
  variants = tuple(getattr(module, "VARIANTS", ()))
  entries = dict(getattr(module, "VARIANT_ENTRY_POINTS", {}))
  if variants or entries:
    if name not in variants and name not in entries:
      known = ", ".join(variants + tuple(entries))
      why = (f"{path} defines no {name!r} variant (its variants: {known})"
             + ("; a GRPO variant sets train.algorithm='grpo' (see configs/demo_grid.py)"
                if name == "grpo" else ""))
      return Variant(name, "", {}, unavailable=why)
    spec = f"{path}:{arg.replace('{variant}', name)}" if arg else f"{path}:{name}"
    variant = Variant(name, spec, {}, entries.get(name, DEFAULT_ENTRY))
  elif name in ES_OVERRIDES:
    variant = Variant(name, config, dict(ES_OVERRIDES[name]))
  else:
    why = (f"{path} takes no variant argument and {name!r} is not one of the ES override sets "
           f"({', '.join(ES_OVERRIDES)})"
           + ("; GRPO needs a config variant with train.algorithm='grpo' and its learner settings "
              "(see configs/demo_grid.py)" if name == "grpo" else ""))
    return Variant(name, "", {}, unavailable=why)
  if importlib.util.find_spec(variant.entry.split(":")[0]) is None:
    return dataclasses.replace(variant, unavailable=f"trainer entry point {variant.entry!r} not found")
  return variant

"""The algorithm seam (issue 56): a required core of fewer than eight members, every other
capability optional with a default, and a new algorithm written as its core alone trains, checkpoints,
resumes and loads through the unchanged trainer."""
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_train import build_tiny_tokenizer, tiny_config
from jaxes.controller import ControllerConfig
from jaxes.train import algorithms, checkpoint, metrics
from jaxes.train.algorithms.base import Algorithm, Capabilities, ReplaysUpdates, Updated
from jaxes.train.algorithms.evolution import EvolutionStrategies
from jaxes.train.algorithms.grpo import GRPO
from jaxes.train.algorithms.sao import SAO
from jaxes.train.policy import load_policy
from jaxes.train.trainer import Trainer
from jaxes.train.update_log import UpdateLog
import helpers_repo

TRAIN = helpers_repo.REPO / "jaxes" / "train"


def _members(cls) -> set[str]:
  return {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))


def test_the_required_core_has_fewer_than_eight_members():
  core = _members(Algorithm)
  assert core == {"name", "checkpoint_item", "controller_config_of", "init", "abstract_state",
                  "params", "update"}
  assert len(core) < 8
  # The optional part does not restate the core, and every algorithm has both.
  assert not core & _members(Capabilities)
  for cls in algorithms.ALGORITHMS.values():
    assert issubclass(cls, Capabilities) and all(hasattr(cls, m) for m in core), cls


def test_the_loop_calls_nothing_outside_the_seam():
  """Every member the trainer, the run state and the start-up compile read of an algorithm is
  declared by the core, ``ReplaysUpdates`` or ``Capabilities`` (so each has a default or is
  required)."""
  declared = _members(Algorithm) | _members(ReplaysUpdates) | _members(Capabilities)
  used = {m for path in ("trainer.py", "state.py", "precompile.py")
          for m in re.findall(r"\balgorithm\.(\w+)", (TRAIN / path).read_text())}
  assert used and used <= declared, sorted(used - declared)


def test_each_algorithm_overrides_only_what_it_uses():
  # The update log is ES's capability alone (absorbs the old logs_updates flag).
  assert issubclass(EvolutionStrategies, ReplaysUpdates)
  assert not issubclass(GRPO, ReplaysUpdates) and not issubclass(SAO, ReplaysUpdates)
  # ES keeps its state whole in its checkpoint item and needs nothing of a finished episode.
  for default in ("item", "checkpoint_host", "on_result"):
    assert getattr(EvolutionStrategies, default) is getattr(Capabilities, default), default
  # Each checks (and builds) its own config block, no other's: config.validate asks it alone.
  assert EvolutionStrategies.check_config is not Capabilities.check_config
  assert GRPO.check_config is not Capabilities.check_config
  # GRPO and SAO decode the current policy, one stream per episode: the defaults.
  for default in ("build_engine", "spec", "record", "plot_label"):
    assert getattr(GRPO, default) is getattr(Capabilities, default), default
    assert getattr(SAO, default) is getattr(Capabilities, default), default
  assert GRPO.donates_params and not EvolutionStrategies.donates_params
  assert not GRPO.needs_initial_params


def test_apply_update_is_update_with_nothing_for_the_decode_side_by_default():
  class Counting(Capabilities):
    def update(self, state, results, context):
      return state + 1, {"results": len(results)}

  assert Counting(None, None, None).apply_update(1, [(0, 0, 1.0)], None) == Updated(2, {"results": 1})
  assert EvolutionStrategies.apply_update is not Capabilities.apply_update   # ES: its version step


# -- a new algorithm: its core alone ---------------------------------------------------------------
class HoldState(NamedTuple):
  params: Any
  updates: jax.Array


class Hold(Capabilities):
  """Keeps the policy as it is and counts its updates: the core, and nothing else."""

  name, checkpoint_item = "Hold", "hold"

  @staticmethod
  def controller_config_of(config):
    return ControllerConfig.from_config(config.controller, population=2, seed=config.seed,
                                        antithetic=False, episodes_per_member=1)

  def init(self, params):
    return HoldState(params, jnp.zeros((), jnp.int32))

  def abstract_state(self):
    return HoldState(self.parts.model.abstract_params, jax.ShapeDtypeStruct((), jnp.int32))

  def params(self, state):
    return state.params

  def update(self, state, results, context):
    return (HoldState(state.params, state.updates + 1),
            {"fitness_mean": float(np.mean([f for _, _, f in results]))})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_an_algorithm_written_as_its_core_trains_resumes_and_loads(tokenizer_dir, tmp_path, monkeypatch):
  monkeypatch.setitem(algorithms.ALGORITHMS, "hold", Hold)
  workdir = tmp_path / "run"

  def run(updates):
    config = tiny_config(tokenizer_dir, **{"train.algorithm": "hold", "train.num_updates": updates,
                                           "controller.mode": "sync", "controller.max_staleness": 0,
                                           "eval.num_tasks": 0})
    return Trainer(config, str(workdir), log=lambda s: None).run()

  first = run(2)
  assert first["version"] == 2 and first["algorithm"] == "hold"
  resumed = run(3)   # from the newest checkpoint; nothing to replay
  assert resumed["updates_this_run"] == 1
  lines = [r for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert [r["version"] for r in lines] == [1, 2, 3]
  for r in lines:   # the default metrics line: the shared part and the update's under "hold"
    assert r["num_results"] == 2 and "fitness" not in r
    assert 0 <= r["hold"]["fitness_mean"] <= 1
  assert list(UpdateLog(str(workdir / "update_log")).records()) == []   # no replay: no log
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"))
  try:
    step = ckpt.steps()[-1]
    updates = ckpt.restore_item(step, "hold", {"updates": jax.ShapeDtypeStruct((), jnp.int32)},
                                partial=True)["updates"]
  finally:
    ckpt.close()
  assert step == 3 and int(updates) == 3
  # Every version's parameters are version 0's: the policy loads under the algorithm's item.
  start, end = load_policy(str(workdir), 0), load_policy(str(workdir))
  assert end.version == 3
  for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(end.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

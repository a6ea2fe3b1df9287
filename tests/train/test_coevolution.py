"""Parameter–context co-evolution through the real trainer: each sampled episode's system prompt
is its member's context, the parents change across updates, and a run that fails after its
first update (in process) and is resumed ends with the parameters and contexts of a run never interrupted. The run uses the
``baseline_only`` stale-result policy, so the resume also covers a second policy through the
trainer (tests/train/test_trainer_staleness.py covers ``weight``, ``pace`` and ``throttle``)."""
import json
import os

import jax
import numpy as np
import pytest

from helpers_train import (SYSTEM, build_tiny_tokenizer, fail_after_update, tiny_config,
                           train_records)
from jaxes.controller.coevolve import Coevolution
from jaxes.errors import ConfigError
from jaxes.train.coevolution import ContextEpisodes, from_config
from jaxes.train.trainer import Trainer
from jaxes.train.transcripts import read_episodes

# Short pieces: a context must leave the tiny model's 192-token row room for two turns.
PIECES = "Be brief.\nCheck paths.\nOne command.\nRead first."


def _config(tmp_path, **overrides):
  return tiny_config(build_tiny_tokenizer(str(tmp_path / "tok")), **{
      "coevolve.enabled": True, "coevolve.pieces": PIECES, "coevolve.max_pieces": 2,
      "controller.mode": "async", "controller.max_staleness": 1, "rollout.sandbox_steps": 2,
      "controller.overage": "baseline_only",
      "env.partial_credit": True, "eval.num_tasks": 0, "rollout.temperature": 0.6,
      "rollout.common_random_numbers": False, "train.num_updates": 4, "train.plot": False,
      "train.checkpoint_every": 2, "train.transcripts_per_update": 4, **overrides})


@pytest.mark.slow
def test_contexts_coevolve_and_resume_exactly_after_a_failure(tmp_path):
  # A warm start (made once, in process; both runs start from it) so that members solve
  # different tasks and theta moves: from the random model every fitness was 0, every update a
  # zero step, and the parameter check below compared two unmoved runs.
  warm = {"warmstart.steps": 60, "warmstart.learning_rate": 1e-2}
  Trainer(_config(tmp_path, **warm, **{"train.num_updates": 0}), str(tmp_path / "init"),
          log=lambda s: None).run()
  config = _config(tmp_path, **warm, **{"warmstart.init_from": str(tmp_path / "init")})
  whole = Trainer(config, str(tmp_path / "a"), log=lambda s: None).run()
  lines = train_records(tmp_path / "a")
  assert any(r["update_norm"] > 0 for r in lines[1:]), lines   # theta moved after the failure point
  parents = {0: [[]], **{r["version"]: r["context_parents"] for r in lines}}
  assert len({json.dumps(p) for p in parents.values()}) > 1, parents   # the parents moved
  # Every sampled episode's prompt is the run's system prompt plus its member's context.
  state = {"seed": config.seed, "parents": 2, "pieces": PIECES.splitlines(),
           "by_version": sorted(parents.items())}
  co = Coevolution.from_state_dict(from_config(config).library, state)
  episodes = read_episodes(os.path.join(tmp_path / "a", "episodes.jsonl"))
  prompts = ContextEpisodes(config, SYSTEM)
  assert len(episodes) >= 8
  for e in episodes:
    assert prompts.prompt(co, e["version"], e["member"]) in e["transcript"][0]["text"]
  assert len({e["transcript"][0]["text"].split("\nuser")[0] for e in episodes}) > 1

  workdir = tmp_path / "b"
  fail_after_update(config, workdir)
  resumed = Trainer(config, str(workdir), log=lambda s: None).run()   # restores, replays, finishes
  assert resumed["version"] == 4
  for x, y in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(whole["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  strip = lambda r: {k: r[k] for k in ("version", "context_parents", "staleness_hist", "weight_sum",
                                       "update_norm")}
  assert [strip(r) for r in train_records(workdir)] == [strip(r) for r in lines]


def test_the_demo_tokenizer_is_built_from_the_pieces(tmp_path):
  from jaxes.train import builders
  config = _config(tmp_path, **{"tokenizer.path": "", "tokenizer.vocab_size": 400})
  without = _config(tmp_path, **{"tokenizer.path": "", "tokenizer.vocab_size": 400,
                                 "coevolve.enabled": False})
  quiet = lambda s: None
  tok = builders.build_tokenizer(config, str(tmp_path / "with"), [], quiet)
  plain = builders.build_tokenizer(without, str(tmp_path / "without"), [], quiet)
  count = lambda t: sum(len(t.encode(p, add_special_tokens=False)) for p in PIECES.splitlines())
  assert count(tok) < count(plain)   # its merges compress the pieces


def test_bad_coevolve_settings_are_one_line(tmp_path):
  from jaxes.train.config import validate
  config = _config(tmp_path)
  config.train.algorithm, config.controller.overage = "grpo", "drop"
  with pytest.raises(ConfigError, match=r"config\.coevolve\.enabled: co-evolves ES members"):
    validate(config)
  config = _config(tmp_path, **{"coevolve.max_pieces": 0})
  with pytest.raises(ConfigError, match=r"config\.coevolve\.max_pieces: must be >= 1"):
    validate(config)
  # A library too long for the cache row is refused before any episode runs.
  config = _config(tmp_path, **{"coevolve.pieces": "\n".join(["Read every file twice " * 12] * 3)})
  with pytest.raises(ConfigError, match=r"config\.coevolve\.pieces: the longest context"):
    Trainer(config, str(tmp_path / "w"), log=lambda s: None).run()
  assert not [n for n in os.listdir(tmp_path / "w" / "checkpoints") if n.isdigit()]   # nothing saved

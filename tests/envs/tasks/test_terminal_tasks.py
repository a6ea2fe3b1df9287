"""TerminalTasks (``env.kind = "terminal"``): task i of a split is family i mod F at
``env.difficulty`` (cycling 1..3 when 0), its turns capped by ``env.max_turns``; the train and
held-out splits differ; episodes follow the config. ``task_families`` reads ``env.families``."""
import pytest

from jaxes.envs import protocol
from jaxes.envs.tasks import generator
from jaxes.envs.tasks.terminal_tasks import TerminalTasks, task_families
from jaxes.train.config import load_config_file

from helpers_repo import REPO


@pytest.fixture
def config():
  c = load_config_file(REPO / "configs" / "demo.py")
  c.env.families, c.env.difficulty, c.env.max_turns = "log_count, find_files,", 0, 3
  return c


def test_task_families_from_the_config_all_when_empty(config):
  assert task_families(config) == ["log_count", "find_files"]
  config.env.families = " , "
  assert task_families(config) == list(generator.FAMILIES)


def test_make_tasks_cycles_families_then_difficulties(config):
  tasks = TerminalTasks().make_tasks(config, "train", 6, 0)
  families = ["log_count", "find_files"]
  want = [generator.generate(families[i % 2], generator.split_seed("train", i, config.seed),
                             generator.DIFFICULTIES[(i // 2) % 3]) for i in range(6)]
  assert [t.name for t in tasks] == [t.name for t in want]
  assert [t.name.split("-")[1] for t in tasks] == ["d1", "d1", "d2", "d2", "d3", "d3"]
  assert all(t.limits.max_turns == 3 for t in tasks)
  assert [t.instruction for t in tasks] == [t.instruction for t in want]


def test_make_tasks_from_start_continues_the_split_and_splits_differ(config):
  config.env.difficulty = 2
  terminal = TerminalTasks()
  whole = terminal.make_tasks(config, "train", 5, 0)
  assert [t.name for t in terminal.make_tasks(config, "train", 3, 2)] == [t.name for t in whole[2:]]
  assert all("-d2-" in t.name for t in whole)
  heldout = {t.name for t in terminal.make_tasks(config, "heldout", 5, 0)}
  assert heldout.isdisjoint(t.name for t in whole)
  config.seed += 1
  assert {t.name for t in terminal.make_tasks(config, "train", 5, 0)}.isdisjoint(
      t.name for t in whole)


def test_prompt_and_tokenizer_texts(config):
  terminal = TerminalTasks()
  assert terminal.default_system_prompt(config) == protocol.SYSTEM_PROMPT
  texts = terminal.tokenizer_texts(config)
  assert protocol.PARSE_ERROR_OBSERVATION in texts and "<action>done</action>" in texts


@pytest.mark.parametrize("sandbox_steps", [0, 3])
def test_make_episode_follows_the_config(config, sandbox_steps):
  config.rollout.sandbox_steps = sandbox_steps
  config.env.partial_credit, config.env.parse_error_penalty = False, 0.25
  task = TerminalTasks().make_tasks(config, "train", 1, 0)[0]
  episode = TerminalTasks().make_episode(config, "be brief")(task, None)   # no sandbox touched yet
  assert isinstance(episode, protocol.Episode)
  assert episode.messages[:2] == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": task.instruction}]
  assert episode.partial_credit is False and episode.parse_error_penalty == 0.25
  # model time counts toward the episode limit only off the deterministic schedule
  assert episode.model_time_counts is (sandbox_steps == 0)

"""TaskFolders (``env.kind = "task_folders"``): ``env.task_build`` resolved against the sandbox
(bad values and docker builds off the docker sandbox one ConfigError each); a split takes the
folders in name order from ``start``, cycling, with ``env.max_turns``; the held-out split reads
``env.heldout_task_dir`` when set; everything else is the terminal environment's."""
import shutil

import pytest

from jaxes.envs.tasks.task_folders import TaskFolders, task_build
from jaxes.envs.tasks.terminal_tasks import TerminalTasks
from jaxes.errors import ConfigError
from jaxes.train.config import load_config_file

from helpers_repo import REPO, TASK_SUITES

SUITE = ["endless-error-count", "harbor-count-lines"]   # tests/task_suites, in name order


@pytest.fixture
def config():
  c = load_config_file(REPO / "configs" / "demo.py")
  c.env.kind, c.env.task_dir, c.env.max_turns = "task_folders", str(TASK_SUITES), 3
  c.env.sandbox, c.env.task_build = "local", "auto"
  return c


def test_task_build_resolves_auto_by_sandbox_and_refuses_the_rest(config):
  assert task_build(config) == "translate"
  config.env.sandbox = "docker"
  assert task_build(config) == "docker"
  config.env.task_build = "translate"
  assert task_build(config) == "translate"
  config.env.task_build = "podman"
  with pytest.raises(ConfigError, match=r"config\.env\.task_build: 'podman' is not one of"):
    task_build(config)
  config.env.sandbox, config.env.task_build = "local", "docker"
  with pytest.raises(ConfigError, match=r"config\.env\.task_build = 'docker'.*env\.sandbox is 'local'"):
    task_build(config)


def test_a_docker_build_off_the_docker_sandbox_stops_before_any_backend(config):
  config.env.task_build = "docker"
  with pytest.raises(ConfigError, match="docker sandbox only"):
    TaskFolders().build_backend(config)


def test_make_tasks_in_name_order_from_start_cycling(config):
  tasks = TaskFolders().make_tasks(config, "train", 3, 1)
  assert [t.name for t in tasks] == [SUITE[1], SUITE[0], SUITE[1]]
  assert all(t.limits.max_turns == 3 for t in tasks)
  assert all(t.image is None for t in tasks)   # translated into the shared image


def test_heldout_reads_its_own_folder_when_set(config, tmp_path):
  heldout = tmp_path / "heldout"
  shutil.copytree(TASK_SUITES / SUITE[0], heldout / SUITE[0])   # one folder: every task is it
  assert [t.name for t in TaskFolders().make_tasks(config, "heldout", 2, 0)] == SUITE
  config.env.heldout_task_dir = str(heldout)
  assert [t.name for t in TaskFolders().make_tasks(config, "heldout", 2, 0)] == [SUITE[0]] * 2
  assert [t.name for t in TaskFolders().make_tasks(config, "train", 2, 0)] == SUITE


def test_empty_or_unloadable_task_dir_is_one_config_error(config, tmp_path):
  config.env.task_dir = ""
  with pytest.raises(ConfigError, match="config.env.task_dir: empty"):
    TaskFolders().make_tasks(config, "train", 1, 0)
  config.env.task_dir = str(tmp_path / "no-such-suite")
  with pytest.raises(ConfigError, match="config.env.task_dir: ") as exc:
    TaskFolders().make_tasks(config, "train", 1, 0)
  assert "\n" not in str(exc.value)


def test_everything_but_the_tasks_is_the_terminal_environments(config):
  folders, terminal = TaskFolders(), TerminalTasks()
  assert folders.kind == "task_folders" and folders.check is terminal.check
  assert folders.default_system_prompt(config) == terminal.default_system_prompt(config)
  assert folders.tokenizer_texts(config) == terminal.tokenizer_texts(config)
  task = folders.make_tasks(config, "train", 1, 0)[0]
  episode = folders.make_episode(config, "be brief")(task, None)   # no sandbox touched yet
  assert episode.task is task and episode.messages[0]["content"] == "be brief"

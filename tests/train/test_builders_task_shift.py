"""The changing environment (env.shift_families): which mix a training job runs, and its keys."""
import pytest

from jaxes.controller import Job
from jaxes.errors import ConfigError
from jaxes.train import builders, defaults
from jaxes.train.config import validate
from jaxes.train.state import Parts


def _config(**env):
  c = defaults.base_config()
  c.env.families, c.env.num_train_tasks, c.env.num_heldout_tasks = "permissions", 3, 2
  c.eval.num_tasks, c.train.num_updates = 2, 4
  for k, v in env.items():
    c.env[k] = v
  return c


def test_jobs_of_versions_from_the_shift_on_run_the_later_mix():
  c = _config(shift_families="log_count", shift_at_update=2)
  validate(c)
  shift = builders.task_shift(c)
  parts = Parts(None, None, builders.training_tasks(c), builders.heldout_tasks(c), shift)
  assert len(shift.train_tasks) == 3 and len(shift.heldout_tasks) == 2
  fams = lambda tasks: {t.name.split("-d")[0] for t in tasks}
  assert fams(parts.train_tasks) == {"permissions"} and fams(shift.train_tasks) == {"log_count"}
  assert fams(shift.heldout_tasks) == {"log_count"}
  job = lambda version: Job(job_id=0, version=version, member=0, task=1, episode=0, attempt=0)
  assert parts.train_task(job(1)) is parts.train_tasks[1]
  assert parts.train_task(job(2)) is shift.train_tasks[1] and parts.train_task(job(7)) is shift.train_tasks[1]
  assert builders.task_shift(_config()) is None


@pytest.mark.parametrize("env, match", [
    ({"shift_families": "log_count", "shift_at_update": 0}, r"^config.env.shift_at_update: must be an update"),
    ({"shift_families": "log_count", "shift_at_update": 5}, r"^config.env.shift_at_update: must be an update"),
    ({"shift_at_update": 2}, r"^config.env.shift_at_update: needs config.env.shift_families"),
    ({"shift_families": "nope", "shift_at_update": 2}, r"^config.env.shift_families: 'nope' is not a task family"),
])
def test_shift_keys_are_checked(env, match):
  with pytest.raises(ConfigError, match=match):
    validate(_config(**env))

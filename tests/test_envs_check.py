"""The checker CLI: per-family table, final JSON line, agents, exit status."""
import json

import pytest

from jaxes.envs import check


def run(capsys, *argv):
  code = check.main(["--backend", "local", "--no-progress", *argv])
  lines = capsys.readouterr().out.strip().splitlines()
  return code, lines, json.loads(lines[-1])


def test_oracle_passes_all(capsys):
  code, lines, summary = run(capsys, "--generated", "14", "--agent", "oracle", "--workers", "2")
  assert code == 0
  assert summary == {"tasks": 14, "passed": 14, "pass_rate": 1.0, "failures": {}, "leaked": 0}
  assert lines[0].split()[:3] == ["family", "tasks", "passed"]
  assert len(lines) == 1 + 14 + 1   # header, one row per family, JSON


def test_noop_passes_none(capsys):
  code, _, summary = run(capsys, "--generated", "6", "--split", "heldout", "--agent", "noop")
  assert code == 0
  assert summary["passed"] == 0 and summary["failures"] == {"FAILED_TESTS": 6}


def test_replay_plays_raw_model_outputs(capsys, tmp_path):
  replay = tmp_path / "turns.json"
  replay.write_text(json.dumps(["no command here", "<command>ls</command>"]))
  code, _, summary = run(capsys, "--generated", "2", "--agent", f"replay:{replay}")
  assert code == 0 and summary["failures"] == {"PARSE_ERROR": 2}


def test_bad_agent_and_bad_replay_file_fail_clearly(tmp_path):
  with pytest.raises(SystemExit, match="expected oracle, noop or replay:FILE"):
    check.main(["--generated", "1", "--agent", "smart"])
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(SystemExit, match="cannot read"):
    check.main(["--generated", "1", "--agent", f"replay:{bad}"])


def test_unplayable_tasks_are_counted_not_fatal():
  from jaxes.envs import make_sandbox
  from jaxes.envs.task import Task
  tests = "def test_x():\n  assert False\n"
  tasks = [Task(name="outside", instruction="x", final_tests=tests, solution="true",
                files=(("/etc/x", b"x"),)),
           Task(name="no-oracle", instruction="x", final_tests=tests)]
  sandbox = make_sandbox("local")
  try:
    results, leaked = check.run_checks(sandbox, tasks, "oracle", progress=False)
  finally:
    sandbox.shutdown()
  summary = check.summarize(results, leaked)
  assert summary["failures"] == {"NO_SOLUTION": 1, "TASK_ERROR": 1} and leaked == 0
  assert "TASK_ERROR=1" in check.family_table(results)

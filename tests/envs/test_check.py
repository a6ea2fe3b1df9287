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
  assert summary == {"tasks": 14, "episodes": 14, "passed": 14, "pass_rate": 1.0,
                     "pass_at_attempts": 1.0, "failures": {}, "excluded": {},
                     # its tests run the agent's script (SCRIPT = '/home/user/bin/…', then run)
                     "tests_run_agent_code": ["shell_script-d1-s24"], "leaked": 0}
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


def test_bad_agent_and_bad_replay_file_fail_clearly(tmp_path, capsys):
  # Set-up errors: one line, exit status 2 (as the help says).
  assert check.main(["--generated", "1", "--agent", "smart"]) == 2
  assert "expected oracle, noop or replay:FILE" in capsys.readouterr().err
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  assert check.main(["--generated", "1", "--agent", f"replay:{bad}"]) == 2
  assert "cannot read" in capsys.readouterr().err


def test_unplayable_tasks_are_counted_not_fatal():
  from jaxes.envs import make_sandbox
  from jaxes.envs.tasks.task import Task
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


def test_bad_task_folders_give_one_line_and_no_traceback(capsys, tmp_path):
  folder = tmp_path / "tasks" / "t1"
  folder.mkdir(parents=True)
  (folder / "task.json").write_text('{"description": "x"}')
  (folder / "test_final_state.py").symlink_to("/etc/passwd")
  assert check.main(["--tasks", str(tmp_path / "tasks"), "--no-progress"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "test_final_state.py leads outside the task folder" in err[0], err
  (folder / "test_final_state.py").unlink()
  (folder / "test_final_state.py").write_text("def test_x():\n  pass\n")
  (folder / "task.json").write_bytes(b'{"description": "\xff"}')
  assert check.main(["--tasks", str(tmp_path / "tasks"), "--no-progress"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "task.json: not UTF-8 text" in err[0], err


@pytest.mark.parametrize("content", ['{"shell_script-d1-s24": "ls"}', '["ok", 3]', '"ls"',
                                     '{"t": [["nested"]]}'])
def test_replay_values_must_be_lists_of_strings(tmp_path, capsys, content):
  bad = tmp_path / "bad.json"
  bad.write_text(content)
  assert check.main(["--generated", "1", "--agent", f"replay:{bad}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "must hold a JSON list of model outputs" in err[0], err


def test_pytest_missing_in_the_sandbox_is_an_infrastructure_error(tmp_path):
  from jaxes.envs import make_sandbox, protocol
  from jaxes.envs.sandboxes.sandbox import SandboxError
  from jaxes.envs.tasks.task import Task
  # The sandbox's python3 without its site packages: a system without python3-pytest.
  task = Task(name="no-pytest", instruction="x", solution="true",
              files=(("/home/user/.py/python3", b'#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n'),),
              setup="chmod +x /home/user/.py/python3",
              final_tests="import pytest\n\ndef test_x():\n  assert True\n")
  sandbox = make_sandbox("local", use_pytest=True, python="/home/user/.py/python3")
  try:
    with sandbox.start(task) as handle:
      with pytest.raises(SandboxError, match="need pytest, which the sandbox's python3 lacks"):
        handle.run_tests()
    results, leaked = check.run_checks(sandbox, [task], "oracle", progress=False)
  finally:
    sandbox.shutdown()
  summary = check.summarize(results, leaked)
  assert summary["failures"] == summary["excluded"] == {protocol.SANDBOX_ERROR: 1}


def test_weak_isolation_only_when_asked_for_and_warned(capsys):
  with pytest.warns(RuntimeWarning, match=r"WEAK ISOLATION \(none\)"):
    code, _, summary = run(capsys, "--generated", "2", "--isolation", "none")
  assert code == 0 and summary["passed"] == 2


def test_local_backend_refuses_up_front_when_its_verifier_lacks_pytest(tmp_path):
  from jaxes.envs import make_sandbox
  from jaxes.envs.sandboxes.sandbox import SandboxError
  from jaxes.envs.tasks.task import Task
  no_pytest = tmp_path / "python3"   # the host's python3 without site packages: no python3-pytest
  no_pytest.write_text('#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n')
  no_pytest.chmod(0o755)
  light = Task(name="light", instruction="x", final_tests="def test_x():\n  assert True\n")
  needs = Task(name="needs-pytest", instruction="x",
               final_tests="import pytest\n\ndef test_x():\n  assert True\n")
  sandbox = make_sandbox("local", python=str(no_pytest))
  try:
    sandbox.check_verifier([light])   # the light runner needs nothing
    with pytest.raises(SandboxError, match=r"1 task\(s\) \(e.g. 'needs-pytest'\) need pytest.*"
                       r"apt-get install python3-pytest"):
      sandbox.check_verifier([light, needs])
  finally:
    sandbox.shutdown()


def test_leaks_count_what_the_check_started_not_the_callers_children(monkeypatch):
  """A process that calls the check (a test worker, a notebook) may have children of its own:
  they are not the check's leaks; a process its episodes leave behind is."""
  import subprocess
  from jaxes.envs import make_sandbox
  from jaxes.envs.tasks.task import Task
  own = subprocess.Popen(["sleep", "30"])
  left = []

  class Leaky:   # an agent whose episode starts a process and never reaps it
    def __init__(self, task):
      pass

    def __call__(self, observation):
      if not left:
        left.append(subprocess.Popen(["sleep", "30"]))
      return "<action>done</action>"

  task = Task(name="t", instruction="x", solution="true", final_tests="def test_x():\n  pass\n")
  sandbox = make_sandbox("local")
  try:
    _, leaked = check.run_checks(sandbox, [task], "oracle", progress=False)
    assert leaked == 0
    monkeypatch.setattr(check, "make_agent", lambda spec: Leaky)
    _, leaked = check.run_checks(sandbox, [task], "leaky", progress=False)
    assert leaked == 1
  finally:
    sandbox.shutdown()
    for p in [own, *left]:
      p.kill()
      p.wait()


@pytest.mark.docker
def test_losing_the_docker_engine_mid_check_prints_the_summary_and_exits_2(capsys, monkeypatch):
  import docker
  from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox

  def lost_engine(backend, **kwargs):
    sandbox = DockerSandbox(create_retries=0)
    # The engine goes away after the sandbox started: every later call finds no socket.
    sandbox._client = docker.DockerClient(base_url="unix:///nonexistent/docker.sock",
                                            version="1.41")
    return sandbox
  monkeypatch.setattr(check, "make_sandbox", lost_engine)
  code = check.main(["--backend", "docker", "--generated", "2", "--no-progress"])
  out, err = capsys.readouterr()
  summary = json.loads(out.strip().splitlines()[-1])
  assert code == 2 and summary["leaked"] is None and summary["excluded"] == {"SANDBOX_ERROR": 2}
  assert "engine stopped answering" in err and "Traceback" not in err

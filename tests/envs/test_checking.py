"""The oracle checkers' shared parts: ``--agent replay:FILE`` parsing (a list of strings, or an
object of such lists; anything else one line naming the file) and the check's exit status."""
import json

import pytest

from jaxes.envs.checking import exit_status, read_replay


def _replay(tmp_path, text: str) -> str:
  path = tmp_path / "replay.json"
  path.write_text(text, encoding="utf-8")
  return f"replay:{path}"


def test_read_replay_takes_a_list_or_an_object_of_lists(tmp_path):
  outputs = ["<command>ls</command>", "<action>done</action>"]
  assert read_replay(_replay(tmp_path, json.dumps(outputs)), "task") == outputs
  by_task = {"count-lines": outputs, "find-files": []}
  assert read_replay(_replay(tmp_path, json.dumps(by_task)), "task") == by_task


@pytest.mark.parametrize("data", ['"ls"', '{"count-lines": "ls"}', '["ls", 3]', '{"a": ["ok", null]}', "7"])
def test_read_replay_rejects_anything_but_lists_of_strings_naming_the_file(tmp_path, data):
  spec = _replay(tmp_path, data)
  with pytest.raises(SystemExit) as exc:
    read_replay(spec, "goal")
  message = str(exc.value)
  assert "\n" not in message
  assert spec[len("replay:"):] in message and "goal names" in message


@pytest.mark.parametrize("text", ["[\"unterminated", None])
def test_read_replay_unreadable_or_malformed_file_is_one_line(tmp_path, text):
  spec = _replay(tmp_path, text) if text is not None else f"replay:{tmp_path / 'missing.json'}"
  with pytest.raises(SystemExit) as exc:
    read_replay(spec, "task")
  message = str(exc.value)
  assert "\n" not in message
  assert message.startswith(f"--agent {spec}: cannot read {spec[len('replay:'):]}")


def test_exit_status_fails_on_leaks_a_missing_oracle_task_or_a_passing_noop():
  assert exit_status("oracle", passed=5, total=5, leaked=0) == 0
  assert exit_status("oracle", passed=4, total=5, leaked=0) == 1
  assert exit_status("oracle", passed=5, total=5, leaked=1) == 1
  assert exit_status("noop", passed=0, total=5, leaked=0) == 0
  assert exit_status("noop", passed=1, total=5, leaked=0) == 1
  # a replayed agent is judged by leaks alone: its outputs may pass any number of tasks
  assert exit_status("replay:x.json", passed=2, total=5, leaked=0) == 0
  assert exit_status("replay:x.json", passed=5, total=5, leaked=2) == 1

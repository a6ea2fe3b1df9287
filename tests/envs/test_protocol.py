"""The Endless Terminals protocol: parsing, exact observation strings, episode state machine."""
import dataclasses

import pytest

from jaxes.envs import make_sandbox, protocol
from jaxes.envs.sandboxes.sandbox import ExecResult
from jaxes.envs.tasks.task import Limits, Task

TESTS = """\
import os

def test_first():
  assert os.path.exists("/home/user/a")

def test_second():
  assert os.path.exists("/home/user/b")
"""
TASK = Task(name="ab", instruction="Create /home/user/a and /home/user/b.", final_tests=TESTS,
            solution="touch /home/user/a /home/user/b")


@pytest.fixture(scope="module")
def sandbox():
  sb = make_sandbox("local")
  yield sb
  sb.shutdown()


@pytest.mark.parametrize("text,kind,command", [
    ("<think>x</think><command>ls -la</command>", "command", "ls -la"),
    ("<command>ls</command> then <command> pwd </command>", "command", "pwd"),   # last wins
    ("<command>rm x</command><action>done</action>", "done", None),               # done wins
    ("<ACTION> done </ACTION>", "done", None),
    ("<command>done</command>", "done", None),
    ("I would run ls here.", "invalid", None),
    ("<command>unclosed", "invalid", None),
    ("<command>\nprintf 'a\\nb'\n</command>", "command", "printf 'a\\nb'"),
])
def test_parse_action(text, kind, command):
  assert protocol.parse_action(text) == protocol.Action(kind, command)


def test_observation_strings_are_endless_terminals():
  ok = ExecResult(exit_code=0, output="hi\n", timed_out=False, output_chars=3)
  assert protocol.format_observation(ok, 50_000, 10) == \
      "Command executed successfully. Output: hi\n\n\n(exit_code=0)"
  bad = ExecResult(exit_code=2, output="no\n", timed_out=False, output_chars=3)
  assert protocol.format_observation(bad, 50_000, 10) == "Command failed. Output: no\n\n\n(exit_code=1)"
  slow = ExecResult(exit_code=-1, output="", timed_out=True, output_chars=0)
  assert protocol.format_observation(slow, 50_000, 10) == (
      "Command failed. Output: \n[Command timed out after 10 seconds and was killed]\n\n(exit_code=1)")
  big = ExecResult(exit_code=0, output="h…t", timed_out=False, output_chars=123_456)
  assert "[Output truncated: showing first 25000 and last 25000 of 123456 characters]" in \
      protocol.format_observation(big, 50_000, 10)


def test_solved_episode_messages_and_reward(sandbox):
  with sandbox.start(TASK) as handle:
    ep = protocol.Episode(TASK, handle)
    assert [m["role"] for m in ep.messages] == ["system", "user"]
    assert ep.messages[0]["content"] == protocol.SYSTEM_PROMPT
    assert ep.messages[1]["content"] == TASK.instruction
    assert not ep.step("<command>touch /home/user/a /home/user/b; echo made</command>")
    assert ep.messages[-1] == {"role": "user", "content":
                               "Command executed successfully. Output: made\n\n\n(exit_code=0)"}
    assert ep.step("<action>done</action>")
    out = ep.finish()
    assert ep.finish() is out
    with pytest.raises(RuntimeError, match="after the episode ended"):
      ep.step("<action>done</action>")
  assert (out.reward, out.passed, out.fraction, out.turns, out.failure) == (1.0, True, 1.0, 2, None)


def test_parse_error_observation_and_partial_credit(sandbox):
  with sandbox.start(TASK) as handle:
    ep = protocol.Episode(TASK, handle, partial_credit=True)
    ep.step("I think I should create the files.")
    assert ep.messages[-1]["content"] == protocol.PARSE_ERROR_OBSERVATION
    ep.step("<command>touch /home/user/a</command>")
    ep.step("<action>done</action>")
    out = ep.finish()
  assert (out.passed, out.fraction, out.reward, out.failure) == (False, 0.5, 0.5, protocol.PARSE_ERROR)
  assert out.parse_errors == 1


def test_parse_error_penalty_is_per_unparsable_reply(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(max_turns=4))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, parse_error_penalty=1.0)
    ep.step("```bash\ntouch /home/user/a /home/user/b\n```")
    ep.step("still no tags")
    ep.step("<command>touch /home/user/a /home/user/b</command>")
    ep.step("<action>done</action>")
    out = ep.finish()
  # Solved, so success counts; the reward pays 1/4 for each of the two unparsable replies.
  assert (out.passed, out.parse_errors, out.reward, out.failure) == (True, 2, 0.5, None)


def test_max_turns_ends_episode_and_tests_still_run(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(max_turns=3))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle)
    assert not ep.step("<command>touch /home/user/a</command>")
    assert not ep.step("<command>true</command>")
    assert ep.step("<command>touch /home/user/b</command>")
    out = ep.finish()
  assert (out.passed, out.turns) == (True, 3)


def test_agent_timeout_gives_zero_without_tests(sandbox):
  now = [0.0]
  task = dataclasses.replace(TASK, limits=Limits(episode_timeout_s=100.0))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, clock=lambda: now[0])
    assert not ep.step("<command>touch /home/user/a /home/user/b</command>")
    now[0] = 101.0
    assert ep.step("<command>true</command>")
    out = ep.finish()
  assert (out.reward, out.passed, out.failure) == (0.0, False, protocol.AGENT_TIMEOUT)


def test_without_model_time_only_commands_count_against_the_episode_limit(sandbox):
  # The deterministic schedule's episodes (model_time_counts=False): hours between replies (a slow
  # machine decoding) end nothing; time inside commands still does.
  now = [0.0]
  task = dataclasses.replace(TASK, limits=Limits(episode_timeout_s=1.0, command_timeout_s=0.6))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, clock=lambda: now[0], model_time_counts=False)
    assert not ep.step("<command>touch /home/user/a /home/user/b</command>")
    now[0] = 3600.0
    assert not ep.step("<command>true</command>")
    assert not ep.step("<command>sleep 0.5</command>")
    assert ep.step("<command>sleep 5</command>")       # cut at the ~0.5 s left, then over
    out = ep.finish()
  assert out.failure == protocol.AGENT_TIMEOUT and out.timings["exec_s"] > 1.0


def test_command_timeout_is_named_and_episode_continues(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(command_timeout_s=0.5))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle)
    assert not ep.step("<command>sleep 30</command>")
    assert "[Command timed out after 0.5 seconds and was killed]" in ep.messages[-1]["content"]
    ep.step("<action>done</action>")
    out = ep.finish()
  assert (out.passed, out.failure) == (False, protocol.COMMAND_TIMEOUT)


def test_test_timeout(sandbox):
  task = dataclasses.replace(TASK, final_tests="import time\n\ndef test_slow():\n  time.sleep(60)\n",
                             limits=Limits(test_timeout_s=0.5))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle)
    ep.step("<action>done</action>")
    out = ep.finish()
  assert (out.passed, out.failure) == (False, protocol.TEST_TIMEOUT)


def test_dead_sandbox_is_sandbox_error(sandbox):
  handle = sandbox.start(TASK)
  ep = protocol.Episode(TASK, handle)
  handle.close()   # the sandbox disappears under the episode
  assert ep.step("<command>ls</command>")
  out = ep.finish()
  assert (out.reward, out.failure) == (0.0, protocol.SANDBOX_ERROR)


def test_run_episode_closes_the_sandbox(sandbox):
  out = protocol.run_episode(sandbox, TASK, lambda messages: f"<command>{TASK.solution}</command>"
                             if len(messages) == 2 else "<action>done</action>")
  assert out.passed and out.turns == 2 and "start_s" in out.timings
  assert sandbox.leftovers() == {"directories": 0}


# -- the fenced action format (env.action_format = "fenced") -----------------------------------
@pytest.mark.parametrize("text,kind,command", [
    ("Let me look.\n```bash\nls -la\n```\nThat lists the files.", "command", "ls -la"),
    ("```bash\nls\n```\nthen\n```sh\npwd\n```", "command", "ls"),                  # first block runs
    ("```python\nprint(1)\n```\n```shell\necho hi\n```", "command", "echo hi"),   # other languages are text
    ("```\ncat a\nwc -l a\n```", "command", "cat a\nwc -l a"),                    # unlabelled: a shell block
    ("  ```Bash title=x\n  echo a\n  ```  ", "command", "echo a"),
    ("```bash\nrm -rf x\n```\n<action>done</action>", "done", None),               # done wins
    ("```bash\ndone\n```", "done", None),
    ("```bash\nls -la", "invalid", None),                                         # unterminated fence
    ("Run ```bash ls``` now.", "invalid", None),                                  # inline, not a block
    ("```python\nimport os\nos.system('ls')\n```", "invalid", None),
    ("```bash\n   \n```", "invalid", None),                                       # empty block
    ("```bash\necho a\x00b\n```", "command", "echo a\x00b"),                      # the sandbox refuses it
    ("<command>ls</command>", "invalid", None),                                   # the other format
    ("I would run ls here.", "invalid", None),
])
def test_parse_fenced(text, kind, command):
  assert protocol.parse_fenced(text) == protocol.Action(kind, command)


def test_parse_fenced_huge_reply_is_linear_and_defined():
  # Many unclosed fences and a megabyte of text: a defined answer, at once (a regular expression
  # over the whole reply took minutes here, backtracking from every opening fence).
  assert protocol.parse_fenced("```bash\n" * 20_000 + "x" * 1_000_000).kind == "invalid"
  assert protocol.parse_fenced("y" * 1_000_000 + "\n```bash\nls\n```" + "\n```" * 20_000) == \
      protocol.Action("command", "ls")


def test_fenced_episode_solves_and_tells_the_format(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(max_turns=3))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, system_prompt=protocol.FENCED.system_prompt,
                          action_format=protocol.FENCED)
    assert not ep.step("<command>touch /home/user/a /home/user/b</command>")   # not this format
    assert ep.messages[-1]["content"] == protocol.FENCED_PARSE_ERROR_OBSERVATION
    assert not ep.step("Two steps:\n```bash\ntouch /home/user/a\ntouch /home/user/b && echo made\n```\n"
                       "```bash\nrm /home/user/a\n```")                          # only the first runs
    assert ep.messages[-1]["content"] == "Command executed successfully. Output: made\n\n\n(exit_code=0)"
    assert ep.step("<action>done</action>")
    out = ep.finish()
  assert (out.passed, out.reward, out.parse_errors, out.turns) == (True, 1.0, 1, 3)


@pytest.mark.parametrize("reply", [
    "```python\nopen('/home/user/a', 'w'); open('/home/user/b', 'w')\n```",     # not run
    "```bash\ntouch /home/user/a /home/user/b",                                  # unterminated: not run
    "x" * 200_000 + "\x00" * 1000,
])
def test_fenced_unparsable_replies_never_act_nor_earn(sandbox, reply):
  task = dataclasses.replace(TASK, limits=Limits(max_turns=2))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, action_format=protocol.FENCED, partial_credit=True)
    assert not ep.step(reply)
    assert ep.commands == 0 and ep.messages[-1]["content"] == protocol.FENCED_PARSE_ERROR_OBSERVATION
    assert ep.step(reply)
    out = ep.finish()
  assert (out.passed, out.reward, out.parse_errors, out.failure) == (False, 0.0, 2, protocol.PARSE_ERROR)


def test_fenced_command_with_a_nul_byte_is_refused_not_run(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(max_turns=1))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, action_format=protocol.FENCED)
    assert ep.step("```bash\ntouch /home/user/a /home/user/b\x00\n```")
    assert "command refused, not run: it contains a NUL byte" in ep.messages[-1]["content"]
    out = ep.finish()
  assert (out.passed, out.reward, out.parse_errors) == (False, 0.0, 0)


def test_fenced_huge_command_output_is_cut_and_stated(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(max_turns=1, output_chars=1000))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle, action_format=protocol.FENCED)
    ep.step("```bash\nhead -c 300000 /dev/zero | tr '\\0' 'z'\n```")
    observation = ep.messages[-1]["content"]
  assert "[Output truncated: showing first 500 and last 500 of 300000 characters]" in observation
  assert len(observation) < 2000

"""Hostile agent input on the local backend: each ends in a defined observation, the episode
goes on (or ends cleanly), nothing leaks, and the host is unharmed."""
import dataclasses
import os
import socket

import pytest

from jaxes.envs import make_sandbox, protocol
from jaxes.envs.check import descendant_processes
from jaxes.envs.tasks.task import Limits, Task

TASK = Task(name="hostile", instruction="Write ok to /home/user/ok.txt.",
            final_tests="def test_ok():\n  assert open('/home/user/ok.txt').read().strip() == 'ok'\n",
            limits=Limits(command_timeout_s=2.0, processes=64, max_turns=4))


@pytest.fixture(scope="module")
def sandbox():
  sb = make_sandbox("local")
  yield sb
  sb.shutdown()


def play(sandbox, first_turn: str, task: Task = TASK):
  """The hostile turn, then a correct solution, then done: the episode must still be winnable."""
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle)
    ep.step(first_turn)
    observation = ep.messages[-1]["content"]
    ep.step("<command>echo ok > /home/user/ok.txt</command>")
    ep.step("<action>done</action>")
    out = ep.finish()
  assert sandbox.leftovers() == {"directories": 0}
  assert descendant_processes() == 0
  return observation, out


def test_fork_bomb(sandbox):
  obs, out = play(sandbox, "<command>:(){ :|:& };:</command>")
  assert obs.startswith("Command ") and obs[-len("(exit_code=0)"):-2] == "(exit_code="
  assert out.passed


FORK_UNTIL_REFUSED = """python3 -c '
import os, time
n = 0
try:
  while n < 1000:
    if os.fork() == 0:
      time.sleep(30)
      os._exit(0)
    n += 1
except OSError:
  print("refused after", n)
'"""


def test_process_limit_stops_forking(sandbox):
  with sandbox.start(TASK) as handle:
    r = handle.exec(FORK_UNTIL_REFUSED, 10)
  assert not r.timed_out   # the sleeping children did not keep the command alive
  last = r.output.splitlines()[-1]
  assert last.startswith("refused after ") and int(last.split()[-1]) < TASK.limits.processes
  assert descendant_processes() == 0


def test_rm_rf_root(sandbox, tmp_path):
  sentinel = tmp_path / "host_file"
  sentinel.write_text("still here")
  obs, out = play(sandbox, "<command>rm -rf --no-preserve-root / 2>&1 | tail -n 3</command>")
  assert obs.startswith("Command executed successfully.") or obs.startswith("Command failed.")
  assert sentinel.read_text() == "still here"
  assert os.path.exists("/usr/bin/python3") and os.path.isdir("/home")
  assert out.passed   # its own home was wiped, then rebuilt by the next command


def test_yes_flood(sandbox):
  obs, out = play(sandbox, "<command>yes</command>")
  assert "characters omitted" in obs and "[Output truncated: showing first 25000 and last 25000" in obs
  assert len(obs) < 60_000
  assert out.passed


def test_sleep_1000(sandbox):
  obs, out = play(sandbox, "<command>sleep 1000</command>")
  assert obs == ("Command failed. Output: \n[Command timed out after 2 seconds and was killed]"
                 "\n\n(exit_code=1)")
  assert out.passed and out.failure is None


def test_binary_and_non_utf8_output(sandbox):
  obs, out = play(sandbox, "<command>printf 'caf\\xe9 \\x00\\x01\\xff\\xfe end'; head -c 2000 "
                           "/usr/bin/python3 >/dev/null; echo</command>")
  assert obs.startswith("Command executed successfully. Output: caf\ufffd \x00\x01\ufffd\ufffd end")
  assert out.passed


def test_host_loopback_unreachable(sandbox):
  if sandbox.isolation == "none":
    pytest.skip("no network namespace in the unisolated fallback")
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  obs, out = play(sandbox, f"<command>python3 -c \"import socket; socket.create_connection(("
                           f"'127.0.0.1', {port}), timeout=1); print('CONNECTED')\"</command>")
  server.setblocking(False)
  with pytest.raises(BlockingIOError):   # no connection ever reached the host's listener
    server.accept()
  server.close()
  assert "CONNECTED" not in obs and obs.startswith("Command failed.")
  assert out.passed


def test_prose_without_command(sandbox):
  obs, out = play(sandbox, "Sure! First I will look around the file system, then write the file.")
  assert obs == protocol.PARSE_ERROR_OBSERVATION
  assert out.passed and out.turns == 3


def test_hostile_episode_that_gives_up_is_scored_zero(sandbox):
  task = dataclasses.replace(TASK, limits=dataclasses.replace(TASK.limits, command_timeout_s=0.5))
  with sandbox.start(task) as handle:
    ep = protocol.Episode(task, handle)
    ep.step("<command>sleep 1000</command>")
    ep.step("<action>done</action>")
    out = ep.finish()
  assert (out.reward, out.failure) == (0.0, protocol.COMMAND_TIMEOUT)

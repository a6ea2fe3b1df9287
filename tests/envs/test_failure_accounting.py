"""Who could have caused a failure decides whether it counts (issue 31): a sandbox that breaks
after the agent acted is a failed episode (reward 0, in fitness); only failures no agent action
can cause are retried and, if they persist, left out -- and a run that leaves out too many stops."""
import pytest

from helpers_sandboxes import sandbox  # noqa: F401  (both backends)
from jaxes.controller import Controller, ControllerConfig
from jaxes.envs import protocol
from jaxes.envs.sandboxes.sandbox import ExecResult, HostError, SandboxError, SandboxHandle, TestReport
from jaxes.envs.tasks.task import Task

TASK = Task(name="t", instruction="x", final_tests="def test_x():\n  assert False\n")


class Breaking(SandboxHandle):
  """A handle whose sandbox fails with ``error`` at the given step ("exec" or "tests")."""

  def __init__(self, error, at):
    self.error, self.at = error, at

  def exec(self, command, timeout_s):
    if self.at == "exec":
      raise self.error
    return ExecResult(0, "", False, 0)

  def run_tests(self):
    if self.at == "tests":
      raise self.error
    return TestReport(False, 0, 1, False, "")

  def close(self):
    pass


@pytest.mark.parametrize("at", ["exec", "tests"])
@pytest.mark.parametrize("error,commands,kind", [
    (SandboxError("container gone"), 1, protocol.SANDBOX_BROKEN),
    (HostError("engine unreachable"), 1, protocol.SANDBOX_ERROR),
    (SandboxError("verifier could not start"), 0, protocol.SANDBOX_ERROR),
])
def test_a_sandbox_failure_counts_once_the_agent_has_acted(at, error, commands, kind):
  if at == "exec" and not commands:
    pytest.skip("no command, no exec")
  ep = protocol.Episode(TASK, Breaking(error, at))
  if not (commands and ep.step("<command>chmod 000 /home/user</command>")):
    ep.step("<action>done</action>")
  out = ep.finish()
  assert (out.reward, out.passed, out.failure) == (0.0, False, kind)
  assert (kind in protocol.EXCLUDED) == (kind == protocol.SANDBOX_ERROR)


def controller(max_retries=1):
  return Controller(ControllerConfig(mode="sync", population=2, episodes_per_member=1,
                                     max_staleness=0, max_retries=max_retries), num_tasks=10)


def test_a_broken_sandbox_counts_zero_in_fitness_and_is_not_retried():
  ctl = controller()
  a, b = ctl.next_jobs(10)
  ctl.report(a.job_id, 0.0, protocol.SANDBOX_BROKEN)
  ctl.report(b.job_id, 1.0)
  assert ctl.next_jobs(10) == []
  update = ctl.pop_update()
  assert update.results == [(0, 0, 0.0), (0, 1, 1.0)] and update.excluded == 0
  assert ctl.excluded_share() == 0.0 and ctl.excluded_beyond(0.05) is None


def test_a_run_leaving_out_more_than_its_limit_stops_with_one_line_naming_the_kinds():
  ctl = controller(max_retries=0)
  reasons = []
  for update in range(10):   # 20 episodes: 1/0.05 finished before the share is judged
    a, b = ctl.next_jobs(10)
    ctl.report(a.job_id, 1.0)
    if update in (3, 7):
      ctl.report(b.job_id, None, protocol.SANDBOX_ERROR)
    else:
      ctl.report(b.job_id, 0.0)
    ctl.pop_update()
    reasons.append(ctl.excluded_beyond(0.05))
  assert reasons[:9] == [None] * 9      # 1 of 8 is 12.5%, but judged from 20 episodes on
  assert ctl.excluded_share() == 0.1
  assert reasons[9] is not None and "\n" not in reasons[9]
  assert "2 of 20 episodes (10.0%)" in reasons[9] and "SANDBOX_ERROR: 2" in reasons[9]
  assert ctl.excluded_beyond(0.1) is None
  restored = Controller.from_state_dict(ctl.state_dict())
  assert restored.excluded_beyond(0.05) == reasons[9]


def test_a_dead_sandbox_is_the_hosts_failure_on_both_backends(sandbox):
  # The host closed the handle (not the agent): excluded, never scored.
  handle = sandbox.start(TASK)
  ep = protocol.Episode(TASK, handle)
  handle.close()
  assert ep.step("<command>ls</command>")
  assert ep.finish().failure == protocol.SANDBOX_ERROR

"""Endless Terminals' agent protocol as a step-wise state machine over one sandbox handle.

Each model turn is parsed like Endless Terminals' pinned parser: an ``<action>done</action>``
anywhere ends the episode; otherwise the *last* ``<command>…</command>`` is executed; otherwise
the turn is a parse error and the model is told so. Observations use Endless Terminals' exact
strings (``(exit_code=0)`` on success, ``(exit_code=1)`` on failure). Long output keeps its
head and tail and states the true length. The episode ends at ``<action>done</action>``, after
``max_turns`` model turns, or when the episode wall-clock limit passes (then no tests run and
the reward is 0, as in Endless Terminals). The final tests decide the reward: 1/0, or the
fraction of tests passed with ``partial_credit=True``; ``parse_error_penalty=p`` subtracts
``p / max_turns`` per unparsable reply (a format reward; success is unaffected).

``FENCED`` (``env.action_format = "fenced"``) is a second way to write the action, the one
instruct models already use in chat: the reply's first fenced shell block (```bash, ```sh,
```shell or an unlabelled fence) is run as one script; ``<action>done</action>`` still ends the
episode. Its observations are the same strings; only the parser, the system prompt's rules and
the parse-error message differ (``ActionFormat``).
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable

from jaxes.envs.sandboxes.sandbox import ExecResult, HostError, SandboxError, SandboxHandle
from jaxes.envs.tasks.task import Task

PARSE_ERROR = "PARSE_ERROR"
AGENT_TIMEOUT = "AGENT_TIMEOUT"
COMMAND_TIMEOUT = "COMMAND_TIMEOUT"
TEST_TIMEOUT = "TEST_TIMEOUT"
# Failures by who could cause them. SANDBOX_ERROR: infrastructure (the sandbox could not start,
# or a HostError), retried and, if it persists, left out of fitness. SANDBOX_BROKEN: the sandbox
# failed after the agent's first command, which the agent may have caused (filled a disk, broke
# its home, killed what it could): a failed episode, reward 0, counted -- else breaking the
# sandbox would be as good as solving, since an excluded episode cannot lower fitness.
SANDBOX_ERROR = "SANDBOX_ERROR"
SANDBOX_BROKEN = "SANDBOX_BROKEN"
EXCLUDED = (SANDBOX_ERROR,)      # the failures that leave an episode out of fitness
FAILURES = (PARSE_ERROR, AGENT_TIMEOUT, COMMAND_TIMEOUT, TEST_TIMEOUT, SANDBOX_BROKEN, SANDBOX_ERROR)

# Our wording of Endless Terminals' rules (same protocol, own text); pass Endless Terminals'
# verbatim system message as ``Episode(..., system_prompt=...)`` to match it exactly.
SYSTEM_PROMPT = """\
You are an agent working in a Linux terminal through a one-command-at-a-time interface.
Your goal is to complete the user's task inside /home/user.

Rules:
- First think inside <think> </think> tags, then end your turn with exactly one of:
  <command>ONE_SHELL_COMMAND</command>   to run a command and see its output, or
  <action>done</action>                  when the task is complete.
- Commands run non-interactively: never wait for input; use non-interactive flags.
- Look before you act: inspect files and directories (ls, cat, head) when you need to.
- Prefer simple, standard command-line tools; write files explicitly.
- Check your result (for example with cat) before you answer <action>done</action>."""

PARSE_ERROR_OBSERVATION = ("Could not parse a single <command>...</command> or <action>done</action>. "
                           "Please respond with exactly one of those.")

_DONE_RE = re.compile(r"<action>\s*done\s*</action>", re.IGNORECASE)
_COMMAND_RE = re.compile(r"<command>\s*(.*?)\s*</command>", re.IGNORECASE | re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Action:
  kind: str                 # "command" | "done" | "invalid"
  command: str | None = None


def parse_action(text: str) -> Action:
  """Done wins anywhere in the turn; else the last <command>; an empty or "done" command
  counts as done/invalid the way Endless Terminals treats them."""
  if _DONE_RE.search(text):
    return Action("done")
  commands = _COMMAND_RE.findall(text)
  if not commands:
    return Action("invalid")
  command = commands[-1].strip()
  if command.lower() == "done":
    return Action("done")
  return Action("command", command)


# The fenced format: a fence opens a line (```, an optional language word) and a line holding only
# ``` closes it. Shell blocks run; a block in another language (python, json, ...) is text.
FENCED_SYSTEM_PROMPT = """\
You are an agent working in a Linux terminal. Your goal is to complete the user's task inside /home/user.

Rules:
- Reply with a short explanation, then exactly one shell command in a ```bash code block.
  I run the first ```bash block of your reply and show you its output.
- Commands run non-interactively: never wait for input; use non-interactive flags.
- Write files explicitly; check your result (for example with cat).
- When the task is complete, reply <action>done</action> instead of a code block."""

FENCED_PARSE_ERROR_OBSERVATION = ("Could not find a ```bash code block or <action>done</action> in your reply. "
                                  "Reply with one shell command in a ```bash code block.")

SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console", "zsh")
# An opening fence line: ``` and an optional language word, nothing after it holding a backtick
# (so an inline ```ls``` opens nothing). A closing fence line is ``` alone.
_FENCE_OPEN_RE = re.compile(r"```[ \t]*([\w+#.-]*)[^`]*")


def _fenced_blocks(text: str):
  """(language, body) of each closed fenced block, in order. Line by line, so linear in the
  text (a regular expression over the whole reply backtracks quadratically on unclosed fences)."""
  language, body = None, []
  for line in text.split("\n"):
    stripped = line.strip()
    if language is None:
      opening = _FENCE_OPEN_RE.fullmatch(stripped)
      if opening:
        language, body = opening.group(1).lower(), []
    elif stripped == "```":
      yield language, "\n".join(body)
      language = None
    else:
      body.append(line)


def parse_fenced(text: str) -> Action:
  """Done wins anywhere in the turn; else the first closed fenced block in a shell language
  (or unlabelled), run as one script. An unterminated fence, a block in another language or an
  empty block is no action. (A command holding a NUL byte is the sandbox's to refuse, as for
  ``<command>``.)"""
  if _DONE_RE.search(text):
    return Action("done")
  for language, body in _fenced_blocks(text):
    if language not in SHELL_LANGUAGES:
      continue
    command = body.strip()
    if not command:
      return Action("invalid")
    return Action("done") if command.lower() == "done" else Action("command", command)
  return Action("invalid")


@dataclasses.dataclass(frozen=True)
class ActionFormat:
  """How a reply writes its action (``env.action_format``): the parser, the rules the default
  system prompt states, and what the agent is told after an unparsable reply."""
  name: str
  parse: Callable[[str], Action]
  system_prompt: str
  parse_error_observation: str


TAGS = ActionFormat("tags", parse_action, SYSTEM_PROMPT, PARSE_ERROR_OBSERVATION)
FENCED = ActionFormat("fenced", parse_fenced, FENCED_SYSTEM_PROMPT, FENCED_PARSE_ERROR_OBSERVATION)
ACTION_FORMATS = {f.name: f for f in (TAGS, FENCED)}


def format_observation(result: ExecResult, output_limit: int, timeout_s: float) -> str:
  """Endless Terminals' observation string for one executed command."""
  output = result.output
  if result.output_chars > output_limit:
    half = output_limit // 2
    output += (f"\n[Output truncated: showing first {half} and last {half} of "
               f"{result.output_chars} characters]")
  if result.timed_out:
    output += f"\n[Command timed out after {timeout_s:g} seconds and was killed]"
  if result.exit_code == 0:
    return f"Command executed successfully. Output: {output}\n\n(exit_code=0)"
  return f"Command failed. Output: {output}\n\n(exit_code=1)"


@dataclasses.dataclass(frozen=True)
class EpisodeOutcome:
  reward: float
  passed: bool
  fraction: float           # fraction of final tests passed (0 when they did not run)
  turns: int                # model turns taken
  parse_errors: int         # replies the protocol could not parse
  failure: str | None       # one of FAILURES, or None (solved, or simply wrong)
  timings: dict             # seconds: exec (sum), tests, total; plus counts


class Episode:
  """One episode over a live handle. The caller owns the handle (starts and closes it).

  clock: seconds, monotonic; the episode wall-clock limit is measured with it (default real
  time, as in Endless Terminals; pass a deterministic clock for reproducible runs).
  model_time_counts: False: the episode limit counts only the time spent in sandbox commands,
  not the time between them (the model's decoding, which follows the machine and its load), so
  that a run on the deterministic schedule ends its episodes alike on any machine and layout.
  action_format: how replies write their action (``TAGS``: Endless Terminals' protocol).
  """

  def __init__(self, task: Task, handle: SandboxHandle, partial_credit: bool = False,
               clock: Callable[[], float] = time.monotonic, system_prompt: str = SYSTEM_PROMPT,
               parse_error_penalty: float = 0.0, model_time_counts: bool = True,
               action_format: ActionFormat = TAGS):
    self.task = task
    self.action_format = action_format
    self.handle = handle
    self.partial_credit = partial_credit
    self.parse_error_penalty = parse_error_penalty
    self._clock = clock
    self._start = clock()
    self.model_time_counts = model_time_counts
    self.messages: list[dict[str, str]] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": task.instruction},
    ]
    self.turns = 0
    self.done = False
    self._ended_by: str | None = None    # AGENT_TIMEOUT, SANDBOX_BROKEN or SANDBOX_ERROR
    self.commands = 0                    # commands handed to the sandbox
    self.parse_errors = 0                # replies that did not parse
    self._command_timed_out = False
    self._exec_s = 0.0
    self._outcome: EpisodeOutcome | None = None

  def step(self, model_text: str) -> bool:
    """Consumes one model turn; returns whether the episode is over."""
    if self.done:
      raise RuntimeError("step() after the episode ended; call finish()")
    limits = self.task.limits
    self.turns += 1
    self.messages.append({"role": "assistant", "content": model_text})
    action = self.action_format.parse(model_text)
    if action.kind == "done":
      self.done = True
      return True
    if action.kind == "invalid":
      self.parse_errors += 1
      self.messages.append({"role": "user", "content": self.action_format.parse_error_observation})
    else:
      remaining = limits.episode_timeout_s - self._elapsed()
      timeout = max(min(limits.command_timeout_s, remaining), 0.001)
      t0 = time.monotonic()
      self.commands += 1
      try:
        result = self.handle.exec(action.command, timeout)
      except SandboxError as e:
        self._ended_by = self._sandbox_failure(e)
        self.done = True
        self.messages.append({"role": "user", "content": f"Sandbox error: {e}"})
        return True
      finally:
        self._exec_s += time.monotonic() - t0
      self._command_timed_out |= result.timed_out
      self.messages.append({"role": "user", "content":
                            format_observation(result, limits.output_chars, timeout)})
    if self._elapsed() > limits.episode_timeout_s:
      self._ended_by = AGENT_TIMEOUT
      self.done = True
    elif self.turns >= limits.max_turns:
      self.done = True
    return self.done

  def _sandbox_failure(self, error: SandboxError) -> str:
    """Who could have caused ``error``: the agent once it has acted, unless the host did."""
    return SANDBOX_ERROR if isinstance(error, HostError) or not self.commands else SANDBOX_BROKEN

  def _elapsed(self) -> float:
    """Seconds counted against the episode limit."""
    return self._clock() - self._start if self.model_time_counts else self._exec_s

  def finish(self) -> EpisodeOutcome:
    """Runs the final tests (unless the episode timed out or the sandbox failed); idempotent."""
    if self._outcome is not None:
      return self._outcome
    self.done = True
    tests_s, failure, report = 0.0, self._ended_by, None
    if failure is None:
      t0 = time.monotonic()
      try:
        report = self.handle.run_tests()
      except SandboxError as e:
        failure = self._sandbox_failure(e)
      tests_s = time.monotonic() - t0
      if report is not None and report.timed_out:
        failure = TEST_TIMEOUT
    passed = report is not None and report.passed and failure is None
    fraction = report.fraction if report is not None and failure is None else 0.0
    if not passed and failure is None:
      failure = COMMAND_TIMEOUT if self._command_timed_out else PARSE_ERROR if self.parse_errors else None
    reward = fraction if self.partial_credit else float(passed)
    reward -= self.parse_error_penalty * self.parse_errors / self.task.limits.max_turns
    self._outcome = EpisodeOutcome(
        reward=reward, passed=passed, fraction=fraction, turns=self.turns,
        parse_errors=self.parse_errors, failure=None if passed else failure,
        timings={"exec_s": self._exec_s, "tests_s": tests_s,
                 "total_s": self._clock() - self._start})
    return self._outcome


def run_episode(sandbox, task: Task, agent: Callable[[list[dict[str, str]]], str],
                partial_credit: bool = False) -> EpisodeOutcome:
  """Starts a sandbox for ``task``, lets ``agent(messages) -> text`` play, scores, closes.
  A sandbox that cannot start gives a SANDBOX_ERROR outcome (reward 0) instead of raising."""
  t0 = time.monotonic()
  try:
    handle = sandbox.start(task)
  except SandboxError:
    return EpisodeOutcome(0.0, False, 0.0, 0, 0, SANDBOX_ERROR,
                          {"start_s": time.monotonic() - t0})
  start_s = time.monotonic() - t0
  try:
    episode = Episode(task, handle, partial_credit)
    while not episode.step(agent(episode.messages)):
      pass
    outcome = episode.finish()
  finally:
    handle.close()
  return dataclasses.replace(outcome, timings={**outcome.timings, "start_s": start_s})

"""agent_proxy: the wire format, which files count as the agent's, and the stand-ins' semantics
against a real agent-code server (a process of its own; never installed into this process)."""
import json
import os
import sys
import textwrap

import pytest

from jaxes.envs.tasks import agent_proxy
from jaxes.envs.tasks.agent_proxy import AgentCodeError, Client, Remote, decode, encode

SOURCE = open(agent_proxy.__file__, encoding="utf-8").read()


def no_refs(value):
  raise TypeError(type(value).__name__)


def test_plain_data_round_trips_through_json_as_builtin_types_only():
  value = [None, True, 3, 2.5, "s", (1, (2,)), {1: "a", ("k",): [b"\x00", bytearray(b"y")]},
           {1, 2}, frozenset({"f"}), 1 + 2j, float("inf")]
  wire = json.loads(json.dumps(encode(value, no_refs)))
  assert decode(wire, no_refs) == value
  with pytest.raises(TypeError):
    encode([object()], no_refs)


@pytest.mark.parametrize("reply", [{"x": 1}, {"t": 1}, {"d": [[1]]}, {"b": 5}, {"b": "zz"},
                                   {"c": [1]}, {"t": [1], "s": [2]}, {"r": {"id": "1"}}])
def test_a_reply_that_is_not_tagged_plain_data_is_refused(reply):
  with pytest.raises(AgentCodeError):
    Client(SOURCE, sys.executable).decode(reply)


# As the sandbox's uid would (the tests' process never runs as root): root may write anywhere.
WHOSE_FILES = textwrap.dedent('''\
  import json, os, sys, tempfile
  exec(sys.stdin.read())
  roots = (os.path.dirname(json.__file__),)
  own = tempfile.mkdtemp()
  print(json.dumps([agent_file(json.__file__, roots), agent_file(own + "/m.py", roots),
                    agent_file(own + "/m.py", roots + (own,)), agent_file("/opt/x/m.py", roots),
                    agent_file("<string>", roots), agent_file(own + "/t.py", roots, {own + "/t.py"})]))
  ''')


@pytest.mark.end_to_end
def test_only_files_under_the_systems_python_that_nothing_lets_us_write_are_not_the_agents():
  import subprocess
  as_user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
  out = subprocess.run(["/usr/bin/python3", "-I", "-c", WHOSE_FILES], input=SOURCE, cwd="/",
                       capture_output=True, text=True, check=True, **as_user).stdout
  # system file: no; in a writable dir: yes, even under a root; elsewhere: yes; no path, ours: no
  assert json.loads(out) == [False, True, True, True, False, False]


AGENT_MODULE = textwrap.dedent('''\
  import helper

  LIMIT = 3

  class Invalid(ValueError):
    pass

  class Stack:
    def __init__(self):
      self.items = []
    def push(self, x):
      self.items.append(x)
    def __len__(self):
      return len(self.items)
    def __eq__(self, other):
      return isinstance(other, Stack) and self.items == other.items

  class AlwaysEqual:
    def __eq__(self, other):
      return True

  class Swallows:
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      return True

  def check(x):
    if x < 0:
      raise Invalid("negative", x)
    print("checked", x)
    return helper.double(x)

  def sort_in_place(xs):
    xs.sort()

  def count(n):
    yield from range(n)

  def write_counts():   # into its reply pipe, ahead of the reply
    import os
    os.write(4, b"2 0 1\\n")
  ''')


@pytest.fixture
def agent(tmp_path):
  (tmp_path / "solution.py").write_text(AGENT_MODULE)
  (tmp_path / "helper.py").write_text("def double(x):\n  return 2 * x\n")
  client = Client(SOURCE, sys.executable)
  saved = list(sys.path)
  sys.path.insert(0, str(tmp_path))   # the server imports with the tests' sys.path
  try:
    yield client, client.value("load", name="solution", origin=str(tmp_path / "solution.py"),
                               search=None)
  finally:
    sys.path[:] = saved
    client.stop()


@pytest.mark.end_to_end
def test_agent_objects_answer_in_plain_data_from_their_own_process(agent, capsys):
  client, solution = agent
  assert isinstance(solution, Remote) and solution.LIMIT == 3
  assert solution.check(4) == 8 and capsys.readouterr().out == "checked 4\n"
  with pytest.raises(solution.Invalid) as caught:
    solution.check(-1)
  assert isinstance(caught.value, ValueError) and caught.value.args == ("negative", -1)
  stack = solution.Stack()
  stack.push(1)
  assert len(stack) == 1 and stack.items == [1] and isinstance(stack, solution.Stack)
  other = solution.Stack()
  other.push(1)
  assert stack == other and stack is not other and solution.Stack() != stack
  xs = [3, 1, 2]
  solution.sort_in_place(xs)
  assert xs == [1, 2, 3]                   # in-place changes come back
  assert list(solution.count(3)) == [0, 1, 2]
  with pytest.raises(TypeError):
    solution.check(lambda: 1)              # the tests' own functions never go there
  pid = client.pid
  assert pid is not None and pid != os.getpid()


@pytest.mark.end_to_end
def test_an_agent_object_never_answers_for_a_plain_value_or_swallows_a_failure(agent):
  client, solution = agent
  assert solution.AlwaysEqual() != 42 and not (solution.AlwaysEqual() == [1, 2])
  with pytest.raises(AssertionError):
    with solution.Swallows():
      assert False


@pytest.mark.end_to_end
def test_a_server_that_answers_garbage_fails_the_call_and_every_later_one(agent):
  client, solution = agent
  with pytest.raises(AgentCodeError, match="a reply of"):
    solution.write_counts()
  with pytest.raises(AgentCodeError):
    solution.check(1)


@pytest.mark.end_to_end
def test_a_server_that_died_fails_the_call(agent):
  client, solution = agent
  os.kill(client.pid, 9)
  with pytest.raises(AgentCodeError, match="exited or was killed"):
    solution.check(1)

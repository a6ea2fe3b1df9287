"""Running a task's final-test file so that the agent's code cannot change the verdict.

The verifier is a ``python3 -I -B -c VERIFIER [PAYLOAD_FILE]`` process and the tests' process
(``RUNNER``) it starts. It reads a JSON
payload (the test source, a per-run secret key, the runner to use, limits) from stdin or, when
started as root, from a root-only file it then deletes; drops to the agent's uid when started
as root; makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: processes of the same uid can then
neither ptrace it nor open its ``/proc/PID/{fd,mem,environ}``, with or without Yama); and only
then starts the tests' process (non-dumpable too) with the payload minus the key, reading back
its counts over a pipe only that process holds. The test source and its expected values therefore exist only in that
process's memory (pytest collects the module from memory too; the file it is pointed at is
empty), never in a file the agent's programs can read while the tests run them. The verdict is
one line carrying an HMAC-SHA256 under the per-run key, so a line printed by anything else (the
agent's leftovers writing into the runner's stdout) never verifies.

No file the agent could write executes in the tests' process (``agent_proxy``): a module the
tests import from the agent's files runs in an agent-code server of its own and answers in
plain data, so the agent's code can neither write the counts, patch pytest, exit the tests'
process early, nor hand back an object that claims to equal what a test expects.

Runners: the light runner imports the module and calls its module-level ``test*`` functions the
way pytest would, without pytest's ~300 ms start-up, for files pytest would run exactly the same
way (no pytest import, fixtures, decorators or test classes); the others go to real pytest,
run in-process with a plugin that counts outcomes.
"""
from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
import secrets

from jaxes.envs.tasks import agent_proxy

# Sent into the sandbox as text: the tests' process and the agent-code server both run it.
_PROXY_SOURCE = open(agent_proxy.__file__, encoding="utf-8").read()
RESULT_TAG = "JAXES_TEST_RESULT "
NO_PYTEST = "no-pytest"          # a verifier status besides "ok": an infrastructure fault
# The agent's home is not usable as the tests' working directory (e.g. it ran `chmod 000` on it):
# the agent's doing, so a failed episode (reward 0), never an excluded one.
CWD_UNUSABLE = "cwd-unusable"
# What a failed report says when its counts exceed the test file's own (expected_count).
MORE_THAN_COLLECTED = "the verdict counts more tests than the file has: forged by code the tests ran"

# Runs inside the sandbox. Whatever goes wrong, its result line is the last thing it prints.
# It holds the key and signs; the tests run in RUNNER, a fresh interpreter it starts, which never
# sees the key (not in its memory, argv, environment or input), and which runs no agent code.
VERIFIER = r"""
import ctypes, hashlib, hmac, json, os, resource, sys
if len(sys.argv) > 1:                       # root-only payload file (docker): read, delete
  with open(sys.argv[1], encoding="utf-8") as f:
    job = json.load(f)
  os.unlink(sys.argv[1])
else:
  job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)                            # nothing the tests start can read our input
key = bytes.fromhex(job.pop("key"))

def report(passed, failed, collected, status="ok"):
  body = "%d %d %d %s" % (passed, failed, collected, status)
  mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
  sys.stdout.flush()
  os.write(1, ("\n" + TAG + body + " " + mac + "\n").encode())
  os._exit(0)

try:
  os.chdir(job["cwd"])                      # as root in docker: the agent's mode bits cannot stop it
except OSError as e:
  print("the tests' working directory is unusable: %r" % (e,))
  report(0, 0, 0, CWD_UNUSABLE)
try:
  uid = job.get("uid")
  if uid is not None and os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(4, 0, 0, 0, 0) != 0:        # PR_SET_DUMPABLE 0
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
  for limit, value in ((resource.RLIMIT_CPU, job["cpu_s"]), (resource.RLIMIT_AS, job["mem_bytes"])):
    resource.setrlimit(limit, (value, value))
except BaseException as e:
  print("verifier set-up failed: %r" % (e,))
  report(0, 0, 0, "setup-failed")
# Decided here, not reported by the tests' process: code there must not be able to claim it.
light = job["runner"] == "light"
if not light:
  import importlib.util
  if importlib.util.find_spec("pytest") is None:
    print("pytest is not installed for the sandbox's python3 (install python3-pytest)")
    report(0, 0, 0, NO_PYTEST)
# posix_spawn, not subprocess: its import alone is a good part of a light run's time.
# The light runner needs no site-packages (-S: a faster start); pytest lives there.
stdin_r, stdin_w = os.pipe()
counts_r, counts_w = os.pipe()
os.set_inheritable(counts_w, True)
argv = [sys.executable, "-I", "-B"] + (["-S"] if light else []) + ["-c", RUNNER, str(counts_w)]
try:
  pid = os.posix_spawn(sys.executable, argv, dict(os.environ),
                       file_actions=[(os.POSIX_SPAWN_DUP2, stdin_r, 0)])
except OSError as e:
  print("verifier set-up failed: %r" % (e,))
  report(0, 0, 0, "setup-failed")
os.close(counts_w)
os.close(stdin_r)
data = json.dumps(job).encode("utf-8")
try:
  while data:                               # all of it, or it died before reading
    data = data[os.write(stdin_w, data):]
except OSError:
  pass
os.close(stdin_w)
counts = b""
while len(counts) < 256:
  chunk = os.read(counts_r, 256)
  if not chunk:
    break
  counts += chunk
status = os.waitpid(pid, 0)[1]
fields = counts.decode("ascii", "replace").split()
if len(fields) == 3 and all(f.isdigit() for f in fields):
  report(int(fields[0]), int(fields[1]), int(fields[2]) == 1)
print("the tests' process ended without its counts (wait status %d)" % status)
report(0, 0, 0)
""".replace("TAG", repr(RESULT_TAG)).replace("NO_PYTEST", repr(NO_PYTEST)).replace(
    "CWD_UNUSABLE", repr(CWD_UNUSABLE))

# The tests' process: non-dumpable before it reads the tests (the programs they run, the
# agent's, run as the same uid), agent modules routed to their own process before any test
# code runs, then it writes "passed failed collected" to the counts pipe.
RUNNER = r"""
import contextlib, ctypes, io, json, linecache, os, sys, types
counts_fd = int(sys.argv[1])
os.set_inheritable(counts_fd, False)        # the programs the tests start never get it
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(4, 0, 0, 0, 0) != 0:          # PR_SET_DUMPABLE 0
  os._exit(3)
job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)

def report(passed, failed, collected):
  sys.stdout.flush()
  os.write(counts_fd, b"%d %d %d\n" % (passed, failed, int(collected)))
  os._exit(0)

source, path = job["source"], job["path"]
linecache.cache[path] = (len(source), None, source.splitlines(True), path)

def agent_code_apart(trusted):
  # From here on no file the agent could write runs in this process (agent_proxy).
  proxy = types.ModuleType("jaxes_agent_proxy")
  exec(compile(job["proxy"], "<jaxes agent proxy>", "exec"), proxy.__dict__)
  return proxy.install(job["proxy"], sys.executable, trusted)

if job["runner"] == "light":
  finder, agent_code = agent_code_apart([path])
  mod = types.ModuleType("test_final_state")
  mod.__file__ = path
  sys.modules[mod.__name__] = mod
  passed, failed, lines = 0, 0, []
  try:
    exec(compile(source, path, "exec"), mod.__dict__)
    tests = [(name, obj) for name, obj in list(vars(mod).items())
             if name.startswith("test") and callable(obj) and not isinstance(obj, type)]
  except BaseException:
    import traceback
    tests = None
    lines.append("ERROR collecting " + path + "\n" + traceback.format_exc(limit=3))
  for name, fn in tests or ():
    out = io.StringIO()
    try:
      with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        fn()
      passed += 1
      lines.append("PASSED " + name)
    except BaseException as e:
      failed += 1
      lines.append("FAILED " + name + " - " + type(e).__name__ + ": " + str(e)[:2000])
  agent_code.stop()
  print("\n".join(lines))
  report(passed, failed, tests is not None)

import ast, pathlib, shutil, tempfile   # the light runner does without them (start-up time)
import pytest
from _pytest.assertion.rewrite import rewrite_asserts
home = tempfile.mkdtemp(prefix="jaxes-verify-")
test_path = os.path.join(home, os.path.basename(path))
# An empty stand-in for pytest to collect: the tests' source stays in this process's memory
# (the agent-code server runs as the same uid and could read a file).
open(test_path, "w").close()
outcomes = {}

class InMemory(pytest.Module):
  def _getobj(self):   # the tests' module from memory, asserts rewritten as pytest's import would
    tree = ast.parse(source, path)
    rewrite_asserts(tree, source.encode("utf-8"), path, self.config)
    mod = types.ModuleType("test_final_state")
    mod.__file__ = path
    sys.modules[mod.__name__] = mod
    exec(compile(tree, path, "exec", dont_inherit=True), mod.__dict__)
    return mod

class Verdict:
  @pytest.hookimpl(tryfirst=True)
  def pytest_pycollect_makemodule(self, parent):   # test_path, the only file collected
    try:
      return InMemory.from_parent(parent, path=pathlib.Path(test_path))
    except TypeError:                                # pytest 6 (an older task image's)
      import py
      return InMemory.from_parent(parent, fspath=py.path.local(test_path))

  def pytest_sessionstart(self, session):   # ahead of pytest's assertion-rewriting importer
    sys.meta_path.remove(finder)
    sys.meta_path.insert(0, finder)

  def pytest_runtest_logreport(self, report):
    if report.failed or (report.when == "call" and hasattr(report, "wasxfail")):
      outcomes[report.nodeid] = False
    elif report.when == "call" and report.passed:
      outcomes.setdefault(report.nodeid, True)

finder, agent_code = agent_code_apart([path, test_path])
try:
  code = pytest.main(["-q", "-rA", "-p", "no:cacheprovider", "-c", os.devnull,
                      "--rootdir=" + home, "--confcutdir=" + home, test_path],
                     plugins=[Verdict()])
finally:
  agent_code.stop()
  shutil.rmtree(home, ignore_errors=True)
good = sum(outcomes.values())
report(good, len(outcomes) - good, code in (0, 1))
"""
VERIFIER = VERIFIER.replace("RUNNER", repr(RUNNER))


def new_key() -> str:
  return secrets.token_hex(32)


def verifier_job(source: str, key: str, runner: str, path: str, cwd: str, cpu_s: int,
                 mem_bytes: int, uid: int | None = None) -> bytes:
  """The verifier's JSON payload (with agent_proxy's source, which the tests' process runs)."""
  return json.dumps({"source": source, "key": key, "runner": runner, "path": path, "cwd": cwd,
                     "cpu_s": cpu_s, "mem_bytes": mem_bytes, "uid": uid,
                     "proxy": _PROXY_SOURCE}).encode()


def parse_verdict(output: str, key: str) -> tuple[int, int, bool, str] | None:
  """(passed, failed, collected, status) from the one result line whose MAC verifies under
  ``key``; None when there is none (killed, crashed, or only forged lines)."""
  for line in reversed(output.splitlines()):
    if not line.startswith(RESULT_TAG):
      continue
    body, _, mac = line[len(RESULT_TAG):].rpartition(" ")
    want = hmac.new(bytes.fromhex(key), body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, want):
      continue
    passed, failed, collected, status = body.split()
    return int(passed), int(failed), collected == "1", status
  return None


def plain_test_names(source: str) -> list[str] | None:
  """Test names when the light runner can run this file exactly like pytest, else None."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return None
  names = []
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
      if any(m.split(".")[0] in ("pytest", "_pytest") for m in mods):
        return None
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
      if node.decorator_list or node.args.args or node.args.vararg or node.args.kwonlyargs:
        return None
      names.append(node.name)
    if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
      return None
    if isinstance(node, ast.AsyncFunctionDef) and node.name.startswith("test"):
      return None
    if isinstance(node, ast.FunctionDef) and node.name in ("setup_module", "teardown_module"):
      return None
  return names or None


def count_tests(source: str) -> int:
  """How many tests a file defines (what a run that never reported counts as failed)."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return 0
  return sum(isinstance(n, ast.FunctionDef) and n.name.startswith("test") for n in ast.walk(tree))


def _multiplier(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int | None:
  """How many items pytest makes of one test (parametrize with literal value lists multiply);
  None where only running pytest could tell."""
  n = 1
  for decorator in node.decorator_list:
    call = decorator if isinstance(decorator, ast.Call) else None
    name = ast.unparse(call.func if call else decorator)
    if name.split(".")[-1] == "parametrize":
      values = call.args[1] if call is not None and len(call.args) >= 2 else None
      if not isinstance(values, (ast.List, ast.Tuple)) or any(
          isinstance(e, ast.Starred) for e in values.elts):
        return None
      n *= len(values.elts)
  return n


def expected_count(source: str) -> int | None:
  """How many tests pytest collects from this file, read from its source alone (so no code of
  the agent's has run when it is known); None where that needs pytest (parametrize over
  computed values, parametrized fixtures, test names bound by assignment or import,
  ``pytest_generate_tests``, inherited test classes). A verdict claiming more tests than this
  is forged by code the tests ran in-process."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return None
  total = 0
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      if any((a.asname or a.name).split(".")[-1].startswith(("test", "Test")) for a in node.names):
        return None
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      if any(isinstance(t, ast.Name) and t.id.startswith(("test", "Test")) for t in targets):
        return None
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      if node.name == "pytest_generate_tests" or any(
          "params" in {k.arg for k in d.keywords} for d in node.decorator_list
          if isinstance(d, ast.Call)):
        return None
      if node.name.startswith("test"):
        n = _multiplier(node)
        if n is None:
          return None
        total += n
    elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
      outer = _multiplier(node)
      if node.bases or outer is None:
        return None
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
          n = _multiplier(item)
          if n is None:
            return None
          total += outer * n
  return total


def counts_hold(source: str, passed: int, failed: int) -> bool:
  """Whether a verdict's counts can be the file's: never more tests than it has (kept behind
  agent_proxy, should the agent's code ever reach the tests' process again)."""
  expected = expected_count(source)
  return expected is None or passed + failed <= expected


_LOADS_CODE = ("exec", "eval", "compile", "__import__", "import_module", "spec_from_file_location",
               "SourceFileLoader", "run_path", "run_module", "load_source")
_SPAWNS = ("run", "call", "check_call", "check_output", "Popen", "system", "popen", "execv",
           "execve", "execvp", "execl", "execlp", "spawnv", "spawnl", "getoutput",
           "getstatusoutput")
# Programs that run what their arguments name (an interpreter, a wrapper).
_RUNNERS = ("python", "bash", "sh", "dash", "zsh", "node", "perl", "ruby", "php", "java", "env",
            "timeout", "xargs", "nohup", "nice", "stdbuf", "sudo", "su", "setpriv")
# Calls that would run the agent's text inside the tests' process, where agent_proxy cannot
# route it to the agent's own: exec/eval of a string, and loaders the runtime guard refuses
# (runpy, ctypes, unpickling), which fail even for the oracle.
_EXECS_TEXT = ("exec", "eval", "compile", "builtins.exec", "builtins.eval", "builtins.compile")
_LOADS_IN_PROCESS = ("run_path", "run_module", "load_source", "CDLL", "PyDLL", "LoadLibrary")
_UNPICKLERS = ("pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "torch")


def _calls_naming(source: str, home: str, wanted) -> bool:
  """Whether a call ``wanted(func_text)`` has a string naming ``home`` among its arguments,
  directly or through a name bound to one (one assignment deep); a subprocess-like call
  (``wanted`` answers "spawn") only when the program it starts is the agent's: a path in
  ``home``, a relative path, an interpreter or wrapper given such a path, or any program run
  with ``cwd`` in ``home`` (an argv that is computed, or a shell string, naming ``home`` at all)."""
  tree = ast.parse(source)
  strings = lambda node: any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                             and n.value.startswith(home) for n in ast.walk(node))
  bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and strings(n.value)
           for t in n.targets if isinstance(t, ast.Name)}
  names_home = lambda node: strings(node) or any(isinstance(n, ast.Name) and n.id in bound
                                                 for n in ast.walk(node))

  def spawns_home(call: ast.Call) -> bool:
    argv = call.args[0] if call.args else None
    if not isinstance(argv, (ast.List, ast.Tuple)) or not argv.elts:   # a shell string…
      return names_home(call) or any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                                     and home in n.value for n in ast.walk(call))
    cwd = [k.value for k in call.keywords if k.arg == "cwd"]
    if any(names_home(c) for c in cwd):
      return True
    program = argv.elts[0]
    if not (isinstance(program, ast.Constant) and isinstance(program.value, str)):
      return names_home(program) or names_home(argv)
    name = program.value
    if name.startswith(home) or ("/" in name and not name.startswith("/")):
      return True
    return name.rsplit("/", 1)[-1].startswith(_RUNNERS) and any(names_home(e) for e in argv.elts[1:])

  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      kind = wanted(ast.unparse(node.func))
      if kind == "spawn" and spawns_home(node) or kind and kind != "spawn" and names_home(node):
        return True
  return False


def runs_agent_code(source: str, home: str = "/home/user", shell: bool = False) -> bool:
  """Whether tests (a Python file, or a test.sh) import or execute a file from the agent's
  home, read statically: a call that loads code (import machinery, exec, runpy) or a
  ``sys.path`` change naming ``home`` among its arguments, or a subprocess that starts the
  agent's program (``_calls_naming``); for a shell script, ``home`` named at all (but as a
  ``cd``). Listed by check (its ``agent_code`` column)."""
  def wanted(func: str):
    last = func.split(".")[-1]
    return "spawn" if last in _SPAWNS else last in _LOADS_CODE or func.startswith("sys.path.")
  if not shell:
    try:
      return _calls_naming(source, home, wanted)
    except SyntaxError:
      pass
  return home in re.sub(r"\bcd\s+" + re.escape(home) + r"\S*", "", source)


def unsafe_verdict(task) -> str | None:
  """Why the task's verdict could be the agent's own doing whatever the verifier does, or None:
  a Harbor test.sh whose tests run the agent's code (as root, which can write the reward), or
  final tests that run the agent's text inside the tests' process (``exec``/``eval`` of it, or
  a loader the verifier's guard refuses). Read statically; training refuses such tasks unless
  ``env.allow_unsafe_verdicts`` (check: ``--allow-unsafe-verdicts``)."""
  if task.verifier_files:
    homes = {task.workdir or "/home/user", "/home/user"}
    for path, data in task.verifier_files:
      if path.endswith((".py", ".sh")) and any(runs_agent_code(
          data.decode("utf-8", "replace"), home, shell=path.endswith(".sh")) for home in homes):
        return (f"its verifier (tests/{path}) runs the agent's code as root, which can write "
                "the reward")
    return None
  for label, source in (("final", task.final_tests), ("initial", task.initial_tests or "")):
    try:
      in_process = _calls_naming(source, "/home/user", lambda func: func in _EXECS_TEXT or (
        func.split(".")[-1] in _LOADS_IN_PROCESS) or (
        func.split(".")[0] in _UNPICKLERS and func.split(".")[-1] in ("load", "loads", "open",
                                                                      "Unpickler")))
    except SyntaxError:
      continue
    if in_process:
      return f"its {label} tests run the agent's files inside the tests' process (exec, runpy, ctypes or unpickling)"
  return None

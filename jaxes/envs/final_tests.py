"""Running a task's final-test file: a light runner for plain files, pytest for the rest.

The light runner imports the test module in one ``python3 -I`` process and calls its
module-level ``test*`` functions the way pytest would, without pytest's ~300 ms start-up. It is
used only for files that pytest would run exactly the same way (no pytest import, fixtures,
decorators or test classes); the others go to real pytest. Both report passed / total counts.
"""
from __future__ import annotations

import ast
import re

RESULT_TAG = "JAXES_TEST_RESULT "

# Runs inside the sandbox as ``python3 -I -c LIGHT_RUNNER FILE``; its last line is the result.
LIGHT_RUNNER = r"""
import contextlib, io, sys, types
path = sys.argv[1]
mod = types.ModuleType("test_final_state")
mod.__file__ = path
sys.modules[mod.__name__] = mod
passed, failed, lines = 0, 0, []
try:
  exec(compile(open(path, encoding="utf-8").read(), path, "exec"), mod.__dict__)
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
print("\n".join(lines))
print("%s%d %d %d" % (TAG, passed, failed, tests is not None))
""".replace("TAG", repr(RESULT_TAG))


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


def parse_light(output: str, expected: int) -> tuple[int, int]:
  """(passed, total) from the light runner's output; all failed when it never reported."""
  for line in reversed(output.splitlines()):
    if line.startswith(RESULT_TAG):
      passed, failed, collected = map(int, line[len(RESULT_TAG):].split())
      return (passed, passed + failed) if collected else (0, expected)
  return 0, expected    # killed (rlimit) or crashed before reporting


def parse_pytest(output: str) -> tuple[int, int]:
  """(passed, total) from pytest's final summary line."""
  summary = [line for line in output.splitlines()
             if re.search(r"\b(passed|failed|error|no tests ran)", line)]
  if not summary:
    return 0, 0
  counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|errors?)", summary[-1]))
  passed = counts.get("passed", 0)
  total = passed + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
  return passed, total

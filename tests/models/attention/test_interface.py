"""The attention interface stays deep (issue 65): every module of ``jaxes.models.attention`` is
under 300 lines, and no function there (nested ones and lambdas included) or in
``jaxes.models.kernels_tpu`` takes more than 6 parameters (``self`` counted)."""
import ast
import pathlib

import jaxes.models.attention
import jaxes.models.kernels_tpu

PACKAGE = pathlib.Path(jaxes.models.attention.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py")) + [pathlib.Path(jaxes.models.kernels_tpu.__file__)]


def parameter_counts(path: pathlib.Path) -> dict[str, int]:
  """Each function's (or lambda's) parameter count, by ``module:line name``."""
  counts = {}
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      a = node.args
      counts[f"{path.name}:{node.lineno} {getattr(node, 'name', 'lambda')}"] = (
          len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg))
  return counts


def test_every_attention_module_is_under_300_lines():
  lines = {p.name: len(p.read_text().splitlines()) for p in MODULES}
  assert len(lines) >= 9 and not {n: c for n, c in lines.items() if c >= 300}


def test_no_attention_function_takes_more_than_6_parameters():
  counts = {k: v for p in MODULES for k, v in parameter_counts(p).items()}
  assert max(counts.values()) == 6   # the counter sees the widest ones (blockwise, kernel_inputs)
  assert not {k: v for k, v in counts.items() if v > 6}

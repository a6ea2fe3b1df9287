"""The package's import graph, read from the source: no import cycle between modules, and no
import from a lower layer to a higher one, in the layer order that docs/design.md writes down.
Every import counts, a function-local one too: deferring an import hides a cycle, it does not
break it."""
import ast
import pathlib
import re
import helpers_repo

ROOT = helpers_repo.REPO
PACKAGE = ROOT / "jaxes"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, modules) -> str | None:
  """The module an imported name lives in: ``jaxes.a.b`` itself, else its longest prefix."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name or None


def import_graph() -> dict[str, set[str]]:
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets |= {_resolve(a.name, modules) for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
        targets |= {_resolve(f"{node.module}.{a.name}", modules) for a in node.names}
    graph[name] = {t for t in targets if t and t != name and t.startswith("jaxes")}
  return graph


def design_layers() -> list[list[str]]:
  """docs/design.md's "Layers" section: a numbered list, lowest layer first, of packages."""
  text = (ROOT / "docs" / "design.md").read_text()
  section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
  return [re.findall(r"`(jaxes(?:\.\w+)?)`", line) for line in section.splitlines()
          if re.match(r"\d+\. ", line)]


def _top_package(module: str) -> str:
  return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_through_others():
  graph = import_graph()
  cycles, done = [], set()

  def visit(module, path):   # depth-first; a module seen on the current path closes a cycle
    if module in path:
      cycles.append(path[path.index(module):] + [module])
      return
    if module in done:
      return
    for target in sorted(graph.get(module, ())):
      visit(target, path + [module])
    done.add(module)

  for module in sorted(graph):
    visit(module, [])
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_go_down_the_layers_in_docs_design():
  layers = design_layers()
  layer_of = {package: i for i, packages in enumerate(layers) for package in packages}
  graph = import_graph()
  packages = {_top_package(m) for m in graph} - {"jaxes"}
  assert packages <= set(layer_of), f"packages with no layer in docs/design.md: {sorted(packages - set(layer_of))}"
  # A package's __main__ is a command line: it composes the layers (docs/design.md).
  upward = sorted(f"{m} -> {t} (layer {layer_of[_top_package(m)] + 1} imports layer {layer_of[_top_package(t)] + 1})"
                  for m, targets in graph.items() for t in targets
                  if not m.endswith(".__main__")
                  and _top_package(m) in layer_of and _top_package(t) in layer_of
                  and _top_package(m) != _top_package(t)
                  and layer_of[_top_package(t)] >= layer_of[_top_package(m)])
  assert not upward, "imports that do not go down a layer:\n" + "\n".join(upward)


def test_the_graph_reader_sees_real_edges():
  # Not vacuous: edges the package is known to have are read, function-local ones included.
  graph = import_graph()
  assert any(t.startswith("jaxes.es") for m, ts in graph.items() if m.startswith("jaxes.controller") for t in ts)
  assert "jaxes.envs.webshop.check" in graph["jaxes.envs.check"]   # imported inside main()
  assert len(design_layers()) >= 4


def test_load_policy_is_public_from_jaxes_train():
  from jaxes.train import load_policy
  from jaxes.train.policy import load_policy as defined
  assert load_policy is defined


def _imported_by_tests() -> set[str]:
  """Every ``jaxes`` module some test module names in an import (``from jaxes.a import b`` names
  ``jaxes.a.b`` where that is a module)."""
  modules, named = _modules(), set()
  for path in (ROOT / "tests").rglob("test_*.py"):
    if "task_suites" in path.parts:
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        named |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        named |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return named & set(modules)


def test_every_module_has_a_test_module_that_imports_it():
  # tests/ mirrors the package, so a module's tests are found by its name; this keeps the mirror
  # from hiding a module that only other modules' tests reach. A command-line entry point
  # (``__main__``) counts when a test module runs it with ``python -m``.
  named = _imported_by_tests()
  texts = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
  packages = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}   # jaxes, jaxes.es, ...
  untested = sorted(m for m in _modules() if m not in packages and m not in named
                    and not (m.endswith(".__main__") and f'"{m.rpartition(".")[0]}"' in texts))
  assert not untested, f"modules no test module imports: {untested}"

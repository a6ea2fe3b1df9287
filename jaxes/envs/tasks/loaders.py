"""Loads external task folders into ``Task``s that run in our sandbox base image.

Endless Terminals folder::

  task.json            {"description": ..., "truth": ..., "name": ...}
  test_initial_state.py, test_final_state.py
  container.def        Apptainer definition; %post -> setup, %files -> files,
                       %environment -> env
  solution.sh          optional oracle

Terminal-Bench-style folder (Terminal-Bench task.yaml or Harbor task.toml)::

  task.yaml | task.toml (+ instruction.md)
  Dockerfile | environment/Dockerfile    RUN -> setup, COPY/ADD -> files, ENV -> env,
                                         WORKDIR -> created and made the agent's start dir
  solution.sh | solution/solve.sh        the oracle
  tests/test_*.py                        the final tests (run-tests.sh / test.sh are not run)

With a ``task_images.TaskImageBuilder`` (``task_build = "docker"``) a folder runs as its authors
wrote it instead: its Dockerfile (or its Apptainer definition, as a Dockerfile) is built into the
task's own image, a Harbor ``tests/test.sh`` is the verifier, and nothing is translated.

Without one, container recipes are translated, not executed as written: package-manager commands
(``apt-get update``, ``apt-get install``, ``pip install``) are dropped when the base image
already has every package they name, creating the user ``user`` is dropped (the image has it),
and anything we cannot translate raises ``TaskLoadError`` naming the file and line.
Terminal-Bench tasks (files outside /home/user) need the docker backend.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import shlex
import stat
import sys
import tomllib

import yaml

from jaxes.envs.images import apptainer, task_images
from jaxes.envs.tasks import final_tests, harbor
from jaxes.envs.images.base_image import (BASE_PACKAGES, MINBASE_PACKAGES, OPTIONAL_PACKAGES,
                              PYTHON_DISTRIBUTIONS, SANDBOX_HOME, SANDBOX_USER)
from jaxes.envs.tasks.task import Limits, Task

log = logging.getLogger(__name__)

IMAGE_PACKAGES = frozenset(BASE_PACKAGES + OPTIONAL_PACKAGES + MINBASE_PACKAGES)
IMAGE_PYTHON = frozenset(PYTHON_DISTRIBUTIONS)
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NOOP = "true"
_APT = {"apt", "apt-get"}
_APT_DROPPED = {"update", "upgrade", "dist-upgrade", "full-upgrade", "clean", "autoclean",
                "autoremove"}
_APT_OPTIONS_WITH_VALUE = {"-o", "--option", "-t", "--target-release", "-c", "--config-file"}
_PIP_OPTIONS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "--trusted-host",
                           "--timeout", "--retries", "-f", "--find-links", "--cache-dir",
                           "--root-user-action", "--progress-bar", "--python-version",
                           "--platform", "--implementation", "--abi"}
_PIP_UNTRANSLATABLE = {"-r", "--requirement", "-e", "--editable", "-c", "--constraint",
                       "--target", "-t", "--prefix", "--root"}


class TaskLoadError(ValueError):
  """A task folder we cannot load; the message names the file (and line)."""


# -- shell recipes ------------------------------------------------------------------------------

# `<<WORD`, `<<-WORD`, `<<'WORD'`; not the here-string `<<<`.
_HEREDOC = re.compile(r"(?<!<)<<(-?)\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?")


def _logical_lines(text: str, first_line: int = 1):
  """Yields (line number, logical line, is_heredoc_body), joining backslash continuations
  and passing here-document bodies through untouched."""
  lines = text.split("\n")
  i = 0
  while i < len(lines):
    number, line = first_line + i, lines[i]
    while line.endswith("\\") and i + 1 < len(lines):
      i += 1
      line = line + "\n" + lines[i]  # bash joins backslash-newline itself
    i += 1
    yield number, line, False
    for strip_tabs, word in _HEREDOC.findall(line):
      while i < len(lines):
        body = lines[i]
        i += 1
        yield first_line + i - 1, body, True
        if (body.lstrip("\t") if strip_tabs else body) == word:
          break


def _apt_packages(words: list[str]) -> list[str]:
  packages, skip = [], False
  for word in words:
    if skip:
      skip = False
    elif word in _APT_OPTIONS_WITH_VALUE:
      skip = True
    elif not word.startswith("-"):
      packages.append(re.split(r"[=:]", word, maxsplit=1)[0])
  return packages


def _pip_distributions(words: list[str], where: str) -> list[str]:
  names, skip = [], False
  for word in words:
    if skip:
      skip = False
    elif word in _PIP_UNTRANSLATABLE or word.split("=", 1)[0] in _PIP_UNTRANSLATABLE:
      raise TaskLoadError(f"{where}: pip option {word} cannot be translated")
    elif word in _PIP_OPTIONS_WITH_VALUE:
      skip = True
    elif not word.startswith("-"):
      name = re.split(r"[\[<>=!~;@ ]", word, maxsplit=1)[0]
      names.append(name.lower().replace("_", "-"))
  return names


def _translate_command(segment: str, where: str) -> str:
  """One simple command: returns it unchanged, or ``true`` when the image already satisfies
  it; raises TaskLoadError for a package command it cannot satisfy."""
  flat = segment.replace("\\\n", " ")
  try:
    words = shlex.split(flat, comments=True)
  except ValueError:
    words = flat.split()
  while words and (words[0] == "sudo" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
    words = words[1:]
  if not words:
    return segment
  if words[0] in _APT:
    sub, *packages = _apt_packages(words[1:]) or [None]
    if sub in _APT_DROPPED:
      return _NOOP
    if sub != "install":
      raise TaskLoadError(f"{where}: cannot translate `{segment.strip()}` (only apt install/"
                          "update/clean are understood)")
    if any("$" in p or "*" in p for p in packages):
      raise TaskLoadError(f"{where}: cannot translate `{segment.strip()}` (computed package names)")
    missing = sorted(set(packages) - IMAGE_PACKAGES)
    if missing:
      raise TaskLoadError(f"{where}: `{segment.strip()}` needs {', '.join(missing)}, which the "
                          "sandbox image does not have (add it to jaxes/envs/images/base_image.py)")
    return _NOOP
  pip_at = None
  if re.fullmatch(r"pip3?(\.\d+)?", words[0]):
    pip_at = 1
  elif re.fullmatch(r"python3?(\.\d+)?", words[0]) and words[1:3] == ["-m", "pip"]:
    pip_at = 3
  elif words[0] == "uv" and words[1:2] == ["pip"]:
    pip_at = 2
  if pip_at is not None:
    if words[pip_at:pip_at + 1] != ["install"]:
      raise TaskLoadError(f"{where}: cannot translate `{segment.strip()}` (only pip install)")
    names = _pip_distributions(words[pip_at + 1:], where)
    missing = sorted(set(names) - IMAGE_PYTHON)
    if missing:
      raise TaskLoadError(f"{where}: `{segment.strip()}` needs python package(s) "
                          f"{', '.join(missing)}, which the sandbox image does not have")
    return _NOOP
  if words[0] in ("useradd", "adduser", "groupadd", "addgroup") and words[-1] == SANDBOX_USER:
    return _NOOP  # the image already has the user (uid 1000) and its group
  return segment


def translate_shell(text: str, source: str, first_line: int = 1) -> str:
  """Translates a shell recipe (%post body, RUN command) line by line; see module doc."""
  out = []
  for number, line, in_heredoc in _logical_lines(text, first_line):
    if in_heredoc:
      out.append(line)
      continue
    # Split on command separators (keeping them) so `apt-get update && apt-get install -y x`
    # becomes `true && true`. Separators inside quotes are rare in package lines; a segment
    # that shlex cannot parse is left as written.
    parts = re.split(r"(&&|\|\||;|\|)", line)
    where = f"{source} line {number}"
    for k in range(0, len(parts), 2):
      translated = _translate_command(parts[k], where)
      if translated != parts[k]:
        indent = parts[k][:len(parts[k]) - len(parts[k].lstrip())]
        parts[k] = f"{indent}{translated} "
    out.append("".join(parts))
  return "\n".join(out)


# -- tests ----------------------------------------------------------------------------------------

def _check_stdlib_only(source: str, path: str) -> None:
  """Final tests run with the image's python3: stdlib and pytest only."""
  try:
    tree = ast.parse(source, filename=path)
  except SyntaxError as err:
    raise TaskLoadError(f"{path} line {err.lineno}: syntax error: {err.msg}") from err
  allowed = set(sys.stdlib_module_names) | IMAGE_PYTHON | {"_pytest"}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      modules = [node.module]
    else:
      continue
    for module in modules:
      if module.split(".")[0] not in allowed:
        raise TaskLoadError(f"{path} line {node.lineno}: imports {module}, which the sandbox "
                            "image does not have (tests must use the stdlib and pytest only)")


MAX_TASK_BYTES = 64 << 20   # what one task may copy into a sandbox (files, tests, recipes)


class _Folder:
  """Reads one task folder without leaving it: every path is resolved with realpath and
  refused, naming the entry, when it leads outside the folder (a symlink to /etc/shadow or
  /root) or is not a regular file or directory (devices, FIFOs, sockets); all bytes read
  count against ``max_bytes``, checked before reading."""

  def __init__(self, folder: str, max_bytes: int = MAX_TASK_BYTES):
    self.path = folder
    self.real = os.path.realpath(folder)
    self.left = self.max_bytes = max_bytes

  def _resolve(self, path: str, where: str) -> str:
    real = os.path.realpath(path)
    if os.path.commonpath([real, self.real]) != self.real:
      entry = os.path.relpath(os.path.abspath(path), os.path.abspath(self.path))
      raise TaskLoadError(f"{where}: {entry} leads outside the task folder (to {real}); "
                          "refusing to follow it")
    return real

  def read_bytes(self, path: str, where: str | None = None) -> bytes:
    where = where or path
    real = self._resolve(path, where)
    try:
      fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
      raise TaskLoadError(f"{where}: cannot read {path}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as f:
      st = os.fstat(fd)
      if not stat.S_ISREG(st.st_mode):
        raise TaskLoadError(f"{where}: {path} is a {_file_kind(st.st_mode)}, not a regular file")
      if st.st_nlink > 1:   # another name of the same bytes may be any file of the host's
        raise TaskLoadError(f"{where}: {path} is a hard link ({st.st_nlink} names), not a file "
                            "of this folder alone")
      if st.st_size > self.left:
        raise TaskLoadError(f"{where}: {path} ({st.st_size} bytes) would take the task past its "
                            f"{self.max_bytes}-byte cap")
      data = f.read(st.st_size + 1)
    if len(data) > self.left:
      raise TaskLoadError(f"{where}: {path} grew past the task's {self.max_bytes}-byte cap")
    self.left -= len(data)
    return data

  def read(self, path: str) -> str:
    data = self.read_bytes(path)
    try:
      return data.decode("utf-8")
    except UnicodeDecodeError as err:
      raise TaskLoadError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err

  def read_optional(self, *paths: str) -> str | None:
    for path in paths:
      if os.path.lexists(path):
        return self.read(path)
    return None

  def isfile(self, path: str) -> bool:
    return os.path.lexists(path) and not os.path.isdir(path)

  def inside(self, base: str, relative: str, where: str) -> str:
    path = os.path.normpath(os.path.join(base, relative))
    if os.path.commonpath([path, os.path.normpath(base)]) != os.path.normpath(base):
      raise TaskLoadError(f"{where}: {relative} is outside the task folder")
    self._resolve(path, where)
    return path

  def collect(self, source: str, dest: str, where: str) -> list[tuple[str, bytes]]:
    if not os.path.lexists(source):
      raise TaskLoadError(f"{where}: {source} does not exist")
    real = self._resolve(source, where)
    if not os.path.isdir(real):
      return [(dest, self.read_bytes(source, where))]
    files = []
    self._walk(source, dest, where, [real], files)
    return files

  def _walk(self, path: str, dest: str, where: str, stack: list[str], files: list) -> None:
    for entry in sorted(os.listdir(path)):
      child, target = os.path.join(path, entry), os.path.join(dest, entry)
      real = self._resolve(child, where)
      if os.path.isdir(real):
        if real in stack:
          raise TaskLoadError(f"{where}: {child} is a symlink loop")
        self._walk(child, target, where, stack + [real], files)
      else:
        files.append((target, self.read_bytes(child, where)))


def _file_kind(mode: int) -> str:
  for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                     (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"),
                     (stat.S_ISDIR, "directory")):
    if test(mode):
      return name
  return "special file"


# -- Endless Terminals ----------------------------------------------------------------------------

_DEF_IGNORED = {"runscript", "labels", "help", "test", "startscript"}


def _parse_container_def(path: str, folder: _Folder):
  """Returns (setup, files, env) from an Apptainer definition file."""
  sections: dict[str, tuple[int, list[str]]] = {}
  current = None
  for number, line in enumerate(folder.read(path).split("\n"), start=1):
    header = re.match(r"^%(\w+)\s*$", line.strip()) if line.startswith("%") else None
    if header:
      current = header.group(1).lower()
      if current in sections:
        raise TaskLoadError(f"{path} line {number}: section %{current} appears twice")
      if current not in ("post", "files", "environment") and current not in _DEF_IGNORED:
        raise TaskLoadError(f"{path} line {number}: section %{current} cannot be translated")
      sections[current] = (number + 1, [])
    elif current is not None:
      sections[current][1].append(line)
    elif line.strip() and not re.match(r"^(Bootstrap|From|Stage|IncludeCmd)\s*:", line.strip(),
                                       re.IGNORECASE) and not line.lstrip().startswith("#"):
      raise TaskLoadError(f"{path} line {number}: cannot translate header `{line.strip()}`")
  ignored = sorted(set(sections) & _DEF_IGNORED)
  if ignored:
    log.info("%s: ignoring %s (not part of the initial state)", path,
             ", ".join("%" + s for s in ignored))

  files = []
  first, lines = sections.get("files", (0, []))
  for offset, line in enumerate(lines):
    words = line.split("#", 1)[0].split()
    if not words:
      continue
    where = f"{path} line {first + offset}"
    if len(words) > 2:
      raise TaskLoadError(f"{where}: cannot translate %files entry `{line.strip()}`")
    dest = words[-1]
    if not dest.startswith("/"):
      raise TaskLoadError(f"{where}: %files destination must be absolute, got {dest}")
    files += folder.collect(folder.inside(folder.path, words[0], where), dest, where)

  env = []
  first, lines = sections.get("environment", (0, []))
  for offset, line in enumerate(lines):
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
      continue
    match = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", stripped)
    if not match:
      raise TaskLoadError(f"{path} line {first + offset}: cannot translate %environment line "
                          f"`{stripped}` (only VAR=value / export VAR=value)")
    value = match.group(2)
    try:
      words = shlex.split(value) if value else [""]
    except ValueError as err:
      raise TaskLoadError(f"{path} line {first + offset}: {err}") from err
    if len(words) != 1 or "$" in value or "`" in value:
      raise TaskLoadError(f"{path} line {first + offset}: cannot translate %environment value "
                          f"`{value}` (no expansions)")
    env.append((match.group(1), words[0]))

  first, lines = sections.get("post", (0, []))
  setup = translate_shell("\n".join(lines), path, first) if lines else ""
  return setup, files, env


def _build_definition(def_path: str, reader: _Folder, name: str,
                      builder: task_images.TaskImageBuilder) -> task_images.BuiltImage:
  """Builds an Apptainer definition as the task's image (see jaxes.envs.images.apptainer)."""
  try:
    recipe = apptainer.parse(reader.read(def_path), def_path)
  except apptainer.DefinitionError as err:
    raise TaskLoadError(str(err)) from err
  files = []
  for source, dest, line in recipe.files:
    where = f"{def_path} line {line}"
    for target, data in reader.collect(reader.inside(reader.path, source, where), dest, where):
      files.append((f"{apptainer.ROOTFS}{target}", data, _mode(data)))
  if recipe.post.strip():
    files.append((apptainer.POST_SCRIPT, recipe.post.encode(), 0o644))
  files.append(("Dockerfile", apptainer.dockerfile(recipe).encode(), 0o644))
  return _ensure_image(builder, name, task_images.BuildContext(tuple(files)))


def _mode(data: bytes) -> int:
  return 0o755 if data.startswith(b"#!") else 0o644


def _ensure_image(builder, name: str, context,
                  needs: tuple[str, ...] = task_images.SHELL_TOOLS + (task_images.PYTHON,)
                  ) -> task_images.BuiltImage:
  try:
    return builder.ensure(name, context, needs)
  except task_images.TaskImageError as err:
    raise TaskLoadError(str(err)) from err


def load_endless_terminals(folder: str, max_bytes: int = MAX_TASK_BYTES,
                           builder: task_images.TaskImageBuilder | None = None) -> Task:
  reader = _Folder(folder, max_bytes)
  meta_path = os.path.join(folder, "task.json")
  try:
    meta = json.loads(reader.read(meta_path))
  except json.JSONDecodeError as err:
    raise TaskLoadError(f"{meta_path} line {err.lineno}: invalid JSON: {err.msg}") from err
  if not isinstance(meta, dict) or not isinstance(meta.get("description"), str):
    raise TaskLoadError(f"{meta_path}: needs a string field \"description\"")
  name = str(meta.get("name") or os.path.basename(os.path.normpath(folder)))
  final_path = os.path.join(folder, "test_final_state.py")
  if not reader.isfile(final_path):
    raise TaskLoadError(f"{folder}: missing test_final_state.py")
  final_tests = reader.read(final_path)
  initial_path = os.path.join(folder, "test_initial_state.py")
  initial_tests = reader.read_optional(initial_path)
  if builder is None:   # a task-built image has the python packages its recipe installs
    _check_stdlib_only(final_tests, final_path)
    if initial_tests is not None:
      _check_stdlib_only(initial_tests, initial_path)
  setup, files, env, image = "", [], [], None
  def_path = os.path.join(folder, "container.def")
  dockerfiles = [p for p in (os.path.join(folder, "Dockerfile"),
                             os.path.join(folder, "environment", "Dockerfile")) if reader.isfile(p)]
  if reader.isfile(def_path) and builder is None:
    setup, files, env = _parse_container_def(def_path, reader)
  elif builder is not None and (reader.isfile(def_path) or dockerfiles):
    # Some redistributions of the suite ship a Dockerfile instead of the Apptainer definition.
    built = (_build_definition(def_path, reader, name, builder) if reader.isfile(def_path) else
             _build_dockerfile(dockerfiles[0], reader, name, builder,
                               task_images.SHELL_TOOLS + (task_images.PYTHON,)))
    image, env = built.tag, list(built.env)
  return Task(
    name=name, instruction=meta["description"], setup=setup, final_tests=final_tests,
    initial_tests=initial_tests, solution=reader.read_optional(os.path.join(folder, "solution.sh")),
    files=tuple(files), env=tuple(env), family="endless-terminals", image=image)


# -- Terminal-Bench / Harbor ----------------------------------------------------------------------

def _dockerfile_instructions(path: str, folder: _Folder):
  """Yields (line number, INSTRUCTION, arguments) with continuations joined."""
  lines = folder.read(path).split("\n")
  i = 0
  while i < len(lines):
    number, line = i + 1, lines[i]
    i += 1
    if not line.strip() or line.lstrip().startswith("#"):
      continue
    while line.rstrip().endswith("\\") and i < len(lines):
      nxt = lines[i]
      i += 1
      if nxt.lstrip().startswith("#"):
        continue
      line = line.rstrip() + "\n" + nxt
    parts = line.strip().split(None, 1)
    yield number, parts[0].upper(), parts[1] if len(parts) > 1 else ""


def _exec_form(args: str) -> list[str] | None:
  if args.lstrip().startswith("["):
    try:
      value = json.loads(args)
    except json.JSONDecodeError:
      return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
      return value
  return None


def _expand(value: str, env: dict[str, str], where: str) -> str:
  """Expands $VAR / ${VAR} in an ENV value from earlier ENVs (and the image's PATH)."""
  known = {"PATH": IMAGE_PATH, "HOME": "/root", **env}

  def lookup(match):
    name = match.group(1) or match.group(2)
    if name not in known:
      raise TaskLoadError(f"{where}: ENV refers to ${name}, which is not set before it")
    return known[name]

  return re.sub(r"\$\{(\w+)\}|\$(\w+)", lookup, value)


def _parse_dockerfile(path: str, context: str, folder: _Folder):
  """Returns (setup, files, env, workdir) from a Dockerfile."""
  setup_lines, files, env = [], [], []
  workdir = "/"
  for number, instruction, args in _dockerfile_instructions(path, folder):
    where = f"{path} line {number}"
    if instruction == "FROM":
      log.info("%s: ignoring FROM %s (tasks run in the jaxes sandbox image)", where, args)
    elif instruction == "RUN":
      if "<<" in args.split("\n", 1)[0] and args.lstrip().startswith("<<"):
        raise TaskLoadError(f"{where}: RUN here-documents cannot be translated")
      words = _exec_form(args)
      command = shlex.join(words) if words is not None else args
      setup_lines.append(f"cd {shlex.quote(workdir)}")
      setup_lines.append(translate_shell(command, path, number))
    elif instruction in ("COPY", "ADD"):
      words = _exec_form(args) or shlex.split(args)
      options = [w for w in words if w.startswith("--")]
      words = [w for w in words if not w.startswith("--")]
      if any(o.startswith("--from") for o in options) or len(words) < 2:
        raise TaskLoadError(f"{where}: cannot translate {instruction} {args}")
      if instruction == "ADD" and any(re.match(r"^\w+://", w) for w in words[:-1]):
        raise TaskLoadError(f"{where}: ADD from a URL cannot be translated (no network)")
      dest = os.path.normpath(os.path.join(workdir, words[-1]))
      for src in words[:-1]:
        if "*" in src or "?" in src:
          raise TaskLoadError(f"{where}: wildcard {src} cannot be translated")
        source = folder.inside(context, src, where)
        target = dest
        if os.path.isfile(source) and (words[-1].endswith("/") or len(words) > 2):
          target = os.path.join(dest, os.path.basename(source))
        files += folder.collect(source, target, where)
    elif instruction == "ENV":
      words = shlex.split(args)
      if words and "=" not in words[0]:  # legacy form: ENV KEY value with spaces
        pairs = [(words[0], " ".join(words[1:]))]
      elif words and all("=" in word for word in words):
        pairs = [tuple(word.split("=", 1)) for word in words]
      else:
        raise TaskLoadError(f"{where}: cannot translate ENV {args}")
      for key, value in pairs:
        env.append((key, _expand(value, dict(env), where)))
    elif instruction == "WORKDIR":
      workdir = os.path.normpath(os.path.join(workdir, args.strip()))
      _check_workdir(workdir, where)
      setup_lines.append(f"mkdir -p {shlex.quote(workdir)}")
    elif instruction in ("CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "STOPSIGNAL",
                         "HEALTHCHECK", "MAINTAINER", "USER"):
      log.info("%s: ignoring %s", where, instruction)
    else:
      raise TaskLoadError(f"{where}: cannot translate {instruction}")
  return "\n".join(setup_lines), files, env, workdir


def _terminal_bench_config(reader: _Folder) -> tuple[str, dict]:
  folder = reader.path
  yaml_path, toml_path = os.path.join(folder, "task.yaml"), os.path.join(folder, "task.toml")
  if reader.isfile(yaml_path):
    try:
      config = yaml.safe_load(reader.read(yaml_path)) or {}
    except yaml.YAMLError as err:
      mark = getattr(err, "problem_mark", None)
      line = f" line {mark.line + 1}" if mark else ""
      raise TaskLoadError(f"{yaml_path}{line}: invalid YAML: {err}") from err
    if not isinstance(config, dict):
      raise TaskLoadError(f"{yaml_path}: expected a mapping")
    instruction = config.get("instruction") or config.get("descriptions", [{}])[0].get(
      "description")
    if not isinstance(instruction, str):
      raise TaskLoadError(f"{yaml_path}: needs a string field \"instruction\"")
    limits = {}
    if "max_agent_timeout_sec" in config:
      limits["episode_timeout_s"] = float(config["max_agent_timeout_sec"])
    if "max_test_timeout_sec" in config:
      limits["test_timeout_s"] = float(config["max_test_timeout_sec"])
    return instruction, limits
  try:
    config = tomllib.loads(reader.read(toml_path))
  except tomllib.TOMLDecodeError as err:
    raise TaskLoadError(f"{toml_path}: invalid TOML: {err}") from err
  instruction = reader.read_optional(os.path.join(folder, "instruction.md"))
  if instruction is None:
    raise TaskLoadError(f"{folder}: task.toml needs instruction.md beside it")
  try:
    return instruction, harbor.limits_from_toml(config, toml_path)
  except ValueError as err:
    raise TaskLoadError(str(err)) from err


# Directories of the image's system: a WORKDIR there would be chowned to the agent, which could
# then plant code (a .pth in site-packages, a library) that the root-phase verifier runs.
SYSTEM_DIRS = ("bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "media", "mnt",
               "opt", "proc", "root", "run", "sbin", "srv", "sys", "usr", "var")


def _check_workdir(workdir: str, where: str) -> None:
  """Refuses a WORKDIR in the system's directories (the agent's home, /tmp and new top-level
  directories such as /app are fine)."""
  top = workdir.strip("/").split("/")[0]
  inside_home = workdir == SANDBOX_HOME or workdir.startswith(SANDBOX_HOME + "/")
  if top in SYSTEM_DIRS and not inside_home:
    raise TaskLoadError(f"{where}: WORKDIR {workdir} is a system directory; the agent's working "
                        f"directory must be in {SANDBOX_HOME}, /tmp or a new top-level directory")


def _verifier_files(reader: _Folder, tests_dir: str) -> tuple[tuple[str, bytes], ...]:
  """The Harbor tests/ folder (test.sh and what it uses), by path relative to it."""
  return tuple(reader.collect(tests_dir, "", tests_dir))


def _build_dockerfile(dockerfile: str, reader: _Folder, name: str,
                      builder: task_images.TaskImageBuilder, needs: tuple[str, ...]
                      ) -> task_images.BuiltImage:
  """Builds the task's Dockerfile with its folder as the context."""
  context_dir = os.path.dirname(dockerfile)
  files = tuple((path, data, 0o755 if os.stat(os.path.join(context_dir, path)).st_mode & 0o111
                 else 0o644) for path, data in reader.collect(context_dir, "", dockerfile))
  return _ensure_image(builder, name, task_images.BuildContext(
    files, dockerfile=os.path.relpath(dockerfile, context_dir)), needs)


def load_terminal_bench(folder: str, max_bytes: int = MAX_TASK_BYTES,
                        builder: task_images.TaskImageBuilder | None = None) -> Task:
  reader = _Folder(folder, max_bytes)
  name = os.path.basename(os.path.normpath(folder))
  instruction, limit_overrides = _terminal_bench_config(reader)
  tests_dir = os.path.join(folder, "tests")
  final_tests, verifier_files = "", ()
  if builder is not None and reader.isfile(os.path.join(tests_dir, "test.sh")):
    verifier_files = _verifier_files(reader, tests_dir)
  else:
    test_files = sorted(f for f in os.listdir(tests_dir) if re.fullmatch(r"test_\w*\.py", f)) if (
      os.path.isdir(tests_dir)) else []
    if len(test_files) != 1:
      raise TaskLoadError(f"{tests_dir}: expected exactly one test_*.py file, found "
                          f"{test_files or 'none'}")
    test_path = os.path.join(tests_dir, test_files[0])
    final_tests = reader.read(test_path)
    if builder is None:   # a task-built image has the python packages its recipe installs
      _check_stdlib_only(final_tests, test_path)
  setup, files, env, workdir, image = "", [], [], SANDBOX_HOME, None
  for dockerfile in (os.path.join(folder, "Dockerfile"),
                     os.path.join(folder, "environment", "Dockerfile")):
    if reader.isfile(dockerfile):
      if builder is None:
        setup, files, env, workdir = _parse_dockerfile(dockerfile, os.path.dirname(dockerfile),
                                                       reader)
      else:
        # A Harbor test.sh is its own verifier: the image needs no python3 for ours.
        needs = task_images.SHELL_TOOLS + (() if verifier_files else (task_images.PYTHON,))
        built = _build_dockerfile(dockerfile, reader, name, builder, needs)
        image, workdir, env = built.tag, os.path.normpath(built.workdir), list(built.env)
        _check_workdir(workdir, f"{dockerfile} (the image's WORKDIR)")
      break
  solution = reader.read_optional(os.path.join(folder, "solution.sh"),
                                  os.path.join(folder, "solution", "solve.sh"))
  if workdir not in ("/", SANDBOX_HOME):
    # The agent starts in /home/user; tell it where the task's working directory is, give
    # that directory to it, and run the oracle there.
    setup += f"\nchown -R {SANDBOX_USER}:{SANDBOX_USER} {shlex.quote(workdir)}"
    instruction = f"(This task's working directory is {workdir}.)\n\n{instruction}"
    if solution is not None:
      solution = f"cd {shlex.quote(workdir)}\n{solution}"
  return Task(
    name=name, instruction=instruction,
    setup=setup.strip("\n"), final_tests=final_tests, solution=solution, files=tuple(files),
    env=tuple(env), limits=Limits(**limit_overrides), family="terminal-bench", image=image,
    workdir=workdir if image is not None else None, verifier_files=verifier_files)


# -- entry points ---------------------------------------------------------------------------------

def task_format(folder: str) -> str | None:
  if os.path.isfile(os.path.join(folder, "task.json")):
    return "endless-terminals"
  if any(os.path.isfile(os.path.join(folder, f)) for f in ("task.yaml", "task.toml")):
    return "terminal-bench"
  return None


def load_task(path: str, max_bytes: int = MAX_TASK_BYTES,
              builder: task_images.TaskImageBuilder | None = None) -> Task:
  """Loads one Endless Terminals or Terminal-Bench-style task folder; it may copy at most
  ``max_bytes`` into the sandbox. With ``builder`` the folder's recipe is built into its own
  image and a Harbor test.sh is its verifier; without, it is translated into the shared image."""
  if not os.path.isdir(path):
    raise TaskLoadError(f"{path}: not a directory")
  kind = task_format(path)
  if kind == "endless-terminals":
    return load_endless_terminals(path, max_bytes, builder)
  if kind == "terminal-bench":
    return load_terminal_bench(path, max_bytes, builder)
  raise TaskLoadError(f"{path}: not a task folder (no task.json, task.yaml or task.toml)")


def load_tasks(directory: str, max_bytes: int = MAX_TASK_BYTES,
               builder: task_images.TaskImageBuilder | None = None,
               allow_unsafe_verdicts: bool = False) -> list[Task]:
  """Every task folder directly under ``directory`` (or ``directory`` itself), by name, but
  those whose verdict the agent's code could decide (``final_tests.unsafe_verdict``): each is
  left out with one line naming it, unless ``allow_unsafe_verdicts`` keeps it (one line too)."""
  if not os.path.isdir(directory):
    raise TaskLoadError(f"{directory}: not a directory")
  if task_format(directory):
    folders = [directory]
  else:
    folders = sorted(os.path.join(directory, d) for d in os.listdir(directory)
                     if task_format(os.path.join(directory, d)))
  if not folders:
    raise TaskLoadError(f"{directory}: contains no task folders")
  tasks = []
  for folder in folders:
    task = load_task(folder, max_bytes, builder)
    why = final_tests.unsafe_verdict(task)
    if why is not None:
      log.warning("%s: %s (task %s): %s", folder, "kept by allow_unsafe_verdicts"
                  if allow_unsafe_verdicts else "refused", task.name, why)
      if not allow_unsafe_verdicts:
        continue
    tasks.append(task)
  if not tasks:
    raise TaskLoadError(f"{directory}: every task folder was refused (their verdicts could be "
                        "the agent's; allow_unsafe_verdicts keeps them)")
  if builder is None:
    log.warning("%s: %d task folder(s) translated into the shared sandbox image (task_build = "
                "\"translate\"): their FROM, package installs and test.sh are not run as written",
                directory, len(folders))
  return tasks

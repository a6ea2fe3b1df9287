"""An Apptainer definition (Endless Terminals' ``container.def``) as a Dockerfile to build.

The recipe is built, not re-expressed: ``Bootstrap: docker`` / ``From:`` is the base image,
``%files`` are copied in first, ``%post`` runs as written (one script, with ``/bin/sh -e`` or
the shell ``%post -c`` names, in ``/``, as Apptainer runs it), and ``%environment``'s
assignments become the image's ``ENV``. Sections that describe the running container
(``%runscript``, ``%labels``, ``%help``, ``%test``, ``%startscript``) do not shape the initial
state and are ignored; any other section raises ``DefinitionError`` naming its line.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex

POST_SCRIPT = ".jaxes/post.sh"   # where the %post script sits in the build context
ROOTFS = "rootfs"                # %files laid out at their destinations in the build context
IGNORED = {"runscript", "labels", "help", "test", "startscript"}


class DefinitionError(ValueError):
  """A definition we cannot build; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Recipe:
  base: str
  files: tuple[tuple[str, str, int], ...]    # (source relative to the folder, dest, line)
  environment: tuple[tuple[str, str], ...]
  post: str
  post_shell: str = "/bin/sh"


def parse(text: str, path: str) -> Recipe:
  header: dict[str, str] = {}
  sections: dict[str, tuple[int, list[str], str]] = {}
  current = None
  for number, line in enumerate(text.split("\n"), start=1):
    found = re.match(r"^%(\w+)(.*)$", line.rstrip()) if line.startswith("%") else None
    if found:
      current, args = found.group(1).lower(), found.group(2).split()
      if current in sections:
        raise DefinitionError(f"{path} line {number}: section %{current} appears twice")
      if current not in ("post", "files", "environment") and current not in IGNORED:
        raise DefinitionError(f"{path} line {number}: section %{current} cannot be built "
                              "with docker")
      shell = "/bin/sh"
      if current == "post" and args:
        if len(args) != 2 or args[0] != "-c":
          raise DefinitionError(f"{path} line {number}: %post takes only `-c SHELL`")
        shell = args[1]
      sections[current] = (number + 1, [], shell)
    elif current is not None:
      sections[current][1].append(line)
    elif line.strip() and not line.lstrip().startswith("#"):
      key, sep, value = line.partition(":")
      if not sep:
        raise DefinitionError(f"{path} line {number}: expected `Key: value`, got "
                              f"`{line.strip()}`")
      header[key.strip().lower()] = value.strip()
  bootstrap = header.get("bootstrap", "docker")
  if bootstrap.lower() != "docker":
    raise DefinitionError(f"{path}: Bootstrap: {bootstrap} cannot be built with docker (only "
                          "Bootstrap: docker)")
  if not header.get("from"):
    raise DefinitionError(f"{path}: no `From:` base image")

  files = []
  first, lines, _ = sections.get("files", (0, [], ""))
  for offset, line in enumerate(lines):
    words = line.split("#", 1)[0].split()
    if not words:
      continue
    if len(words) > 2:
      raise DefinitionError(f"{path} line {first + offset}: cannot build %files entry "
                            f"`{line.strip()}`")
    source, dest = words[0], words[-1]
    if len(words) == 1:
      dest = "/" + source.lstrip("./")
    if not dest.startswith("/"):
      raise DefinitionError(f"{path} line {first + offset}: %files destination must be "
                            f"absolute, got {dest}")
    files.append((source, dest, first + offset))

  environment = []
  first, lines, _ = sections.get("environment", (0, [], ""))
  for offset, line in enumerate(lines):
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
      continue
    found = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", stripped)
    try:
      words = shlex.split(found.group(2)) if found and found.group(2) else [""]
    except ValueError as err:
      raise DefinitionError(f"{path} line {first + offset}: {err}") from None
    # Docker's ENV expands $VAR / ${VAR} as the shell would, but runs no command substitution.
    if not found or len(words) != 1 or "$(" in found.group(2) or "`" in found.group(2):
      raise DefinitionError(f"{path} line {first + offset}: cannot build %environment line "
                            f"`{stripped}` (only VAR=value / export VAR=value, no command substitution)")
    environment.append((found.group(1), words[0]))
  _, post, shell = sections.get("post", (0, [], "/bin/sh"))
  return Recipe(header["from"], tuple(files), tuple(environment), "\n".join(post), shell)


def dockerfile(recipe: Recipe) -> str:
  """The Dockerfile that builds ``recipe`` from a context holding ``ROOTFS/`` (the %files at
  their destinations) and ``POST_SCRIPT``."""
  lines = [f"FROM {recipe.base}"]
  if recipe.files:
    lines.append(f"COPY {ROOTFS}/ /")
  if recipe.post.strip():
    lines += [f"COPY {POST_SCRIPT} /tmp/jaxes-post.sh",
              f"RUN cd / && {shlex.quote(recipe.post_shell)} -e /tmp/jaxes-post.sh && "
              "rm -f /tmp/jaxes-post.sh"]
  for key, value in recipe.environment:
    # Docker expands $VAR in ENV from the variables set before it, as the shell does when
    # Apptainer sources %environment.
    lines.append(f"ENV {key}={json.dumps(value)}")
  return "\n".join(lines) + "\n"

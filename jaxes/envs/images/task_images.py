"""Builds a task's own docker image from its recipe, cached by a content hash of the build context.

A task folder's ``Dockerfile`` (Harbor: ``environment/Dockerfile``; Endless Terminals: the
Dockerfile ``jaxes.envs.images.apptainer`` writes from ``container.def``) is built by the docker
engine with its folder as the context, through the docker SDK. The image is tagged
``jaxes-task/<name>:<hash>``, the hash covering every file of the context (paths, bytes, modes),
so an unchanged folder is never built twice and a changed one always is. A build is tagged
``<tag>-unchecked`` until the probe below has passed, so the final tag exists only for images
that passed it. Each build's log is kept in ``log_dir``; a failing build raises
``TaskImageError`` in one line naming the step.

What the image provides is the task's; the episode protocol, the agent's user (uid 1000,
``user``, home /home/user) and the verifier are ours, so a built image must have bash,
coreutils' ``timeout``, util-linux's ``setpriv``, ``/usr/bin/python3`` and that user: images
``FROM jaxes-sandbox:latest`` have them. Others are probed after their build: an image without
that user (most run as root) gets it in one more layer (its own uid-1000 user renamed, or a new
one); one without the tools is refused, saying what is missing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import re
import shlex
import tarfile
import time

REPOSITORY = "jaxes-task"
# Bumped when what goes into an image besides the folder changes (the probe, the translation).
RECIPE_VERSION = "3"
DEFAULT_LOG_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                               "jaxes", "task-images")
_NEEDS = {"/bin/bash": "bash", "/usr/bin/timeout": "coreutils (timeout)",
          "/usr/bin/setpriv": "util-linux (setpriv)", "/usr/bin/python3": "python3"}
SHELL_TOOLS = ("/bin/bash", "/usr/bin/timeout", "/usr/bin/setpriv")   # every episode's
PYTHON = "/usr/bin/python3"          # the pytest verifier's (not needed by a Harbor test.sh)
AGENT_UID = 1000
DEFAULT_MAX_IMAGE_MB = 8192   # Terminal-Bench 2 images run to a few GiB
AGENT_USER = f"the user 'user' with uid {AGENT_UID} and home /home/user"
_PROBE_USER = (f"; [ \"$(id -u user 2>/dev/null)\" = {AGENT_UID} ] && [ -d /home/user ] || "
               f"echo {shlex.quote('missing: ' + AGENT_USER)}; true")
# Gives the image our agent's user: renames the image's own uid-1000 user (ubuntu, node…) if it
# has one, else creates it.
_USER_LAYER = """FROM {base}
USER root
RUN set -e; old="$(getent passwd 1000 | cut -d: -f1)"; \\
    if [ -n "$old" ] && [ "$old" != user ]; then usermod -l user -d /home/user -m "$old"; \\
    elif [ -z "$old" ]; then useradd --create-home --home-dir /home/user --uid 1000 --shell /bin/bash user; fi; \\
    mkdir -p /home/user && chown 1000:1000 /home/user
"""


def _errors():
  # The docker SDK is imported only when an image is built: loading task folders for the
  # translation (local backend) needs no engine and pays nothing for it.
  import docker
  import requests
  return docker.errors.DockerException, requests.exceptions.RequestException


class TaskImageError(ValueError):
  """A task image that cannot be built or used; one line naming the task and the step."""


@dataclasses.dataclass(frozen=True)
class BuildContext:
  """A build's context: (path relative to the context, bytes, mode) and the Dockerfile's path."""
  files: tuple[tuple[str, bytes, int], ...]
  dockerfile: str = "Dockerfile"

  def digest(self, network: str = "none") -> str:
    """Covers the files and the network the build's RUN steps had (what they could fetch)."""
    h = hashlib.sha256(f"jaxes task image {RECIPE_VERSION}\0{self.dockerfile}\0".encode())
    if network != "none":
      h.update(f"network {network}\0".encode())
    for path, data, mode in sorted(self.files):
      h.update(f"{path}\0{mode:o}\0{len(data)}\0".encode())
      h.update(data)
    return h.hexdigest()

  def tar(self) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
      for path, data, mode in sorted(self.files):
        info = tarfile.TarInfo(path)
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class BuiltImage:
  tag: str
  built: bool          # False: the cached image was used
  seconds: float       # build time (0 when cached)
  workdir: str         # the image's WORKDIR ("/" when it sets none)
  env: tuple[tuple[str, str], ...]   # the image's ENV: what the agent's commands run with
  log_path: str | None


def image_tag(name: str, context: BuildContext, network: str = "none") -> str:
  safe = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip(".-_") or "task"
  return f"{REPOSITORY}/{safe[:100]}:{context.digest(network)[:20]}"


class TaskImageBuilder:
  """Builds task images with the docker engine; ``rebuild`` builds even when cached, without
  the engine's layer cache either.

  network: the network its ``RUN`` steps get: "none" (the default: a recipe reaches nothing,
           not even services listening on the host's docker bridge), or a docker network mode
           ("default", "bridge", "host", a network's name) for suites that install packages
           as they build. Base images are pulled by the engine either way. Episodes never
           have a network.
  max_image_mb: an image larger than this (its size as the engine reports it, base layers
           included) is removed and refused in one line.
  """

  def __init__(self, client=None, log_dir: str = DEFAULT_LOG_DIR, rebuild: bool = False,
               network: str = "none", timeout_s: float = 1800.0,
               max_image_mb: int = DEFAULT_MAX_IMAGE_MB):
    import docker
    try:
      self.client = client or docker.from_env(timeout=int(timeout_s))
      self.client.ping()
    except _errors() as err:
      raise TaskImageError(f"building task images needs a docker engine; none answers: {err}") \
        from err
    self.log_dir, self.rebuild, self.network = log_dir, rebuild, network
    self.max_image_mb = max_image_mb
    self.builds: list[tuple[str, BuiltImage]] = []   # (task name, result), in load order

  def _cached(self, tag: str):
    import docker
    try:
      return self.client.images.get(tag)
    except docker.errors.ImageNotFound:
      return None
    except _errors() as err:
      raise TaskImageError(f"cannot inspect image {tag}: {err}") from err

  def ensure(self, name: str, context: BuildContext,
             needs: tuple[str, ...] = SHELL_TOOLS + (PYTHON,)) -> BuiltImage:
    """The task's image, built unless an image of this exact context exists; ``needs``: the
    executables the task's episodes use (a Harbor test.sh verifier needs no python3)."""
    tag = image_tag(name, context, self.network)
    image = None if self.rebuild else self._cached(tag)
    if image is not None:
      self._check_size(name, image, tag)
      result = BuiltImage(tag, False, 0.0, _workdir(image), _env(image), None)
    else:
      result = self._build(name, tag, context, needs)
    self.builds.append((name, result))
    return result

  def _check_size(self, name: str, image, tag: str) -> None:
    size_mb = (image.attrs.get("Size") or 0) / (1 << 20)
    if size_mb > self.max_image_mb:
      try:
        self.client.images.remove(tag, force=True)
      except _errors():
        pass
      raise TaskImageError(f"task {name}: its image is {size_mb:,.0f} MiB, over the cap of "
                           f"{self.max_image_mb:,} MiB (max_image_mb; check --max-image-mb); "
                           "removed")

  def _stream(self, context: BuildContext, tag: str, lines: list[str]) -> tuple[str | None, str | None]:
    """Builds ``context`` as ``tag``, appending the log to ``lines``; returns (error, step)."""
    step, error = None, None
    try:
      # The low-level API streams the log as it comes (the high-level build returns it only at
      # the end), so a failure's step is known and the log is kept whatever happens.
      events = self.client.api.build(
        fileobj=io.BytesIO(context.tar()), custom_context=True, dockerfile=context.dockerfile,
        tag=tag, rm=True, forcerm=True, pull=False, nocache=self.rebuild, decode=True,
        network_mode=self.network)
      for event in events:
        text = event.get("stream") or event.get("status") or ""
        if text:
          lines.append(text)
          found = re.match(r"Step (\d+/\d+) : (.*)", text.strip())
          if found:
            step = f"step {found.group(1)} `{found.group(2)[:120]}`"
        if "error" in event:
          error = event.get("errorDetail", {}).get("message") or event["error"]
          lines.append(f"ERROR: {error}\n")
    except _errors() as err:
      error = f"{type(err).__name__}: {err}"
      lines.append(f"ERROR: {error}\n")
    return error, step

  def _build(self, name: str, tag: str, context: BuildContext, needs: tuple[str, ...]
             ) -> BuiltImage:
    os.makedirs(self.log_dir, exist_ok=True)
    log_path = os.path.join(self.log_dir, tag.replace("/", "_").replace(":", "_") + ".log")
    started = time.monotonic()
    unchecked = f"{tag}-unchecked"
    lines: list[str] = []
    try:
      error, step = self._stream(context, unchecked, lines)
      if error is not None:
        where = f" at {step}" if step else ""
        raise TaskImageError(f"task {name}: image build failed{where}: "
                             f"{' '.join(error.split())[:300]} (build log: {log_path})")
      missing = self._probe(name, unchecked, needs, log_path)
      if missing == [AGENT_USER]:
        # The task's image runs as root (Harbor's agents do); ours is uid 1000: add it on top.
        lines.append(f"-- jaxes: adding the agent's user (uid {AGENT_UID}) on top\n")
        layer = BuildContext((("Dockerfile", _USER_LAYER.format(base=unchecked).encode(), 0o644),))
        error, step = self._stream(layer, unchecked, lines)
        if error is not None:
          raise TaskImageError(f"task {name}: the image has no user 'user' with uid 1000 and "
                               f"adding one failed: {' '.join(error.split())[:200]} "
                               f"(build log: {log_path})")
        missing = self._probe(name, unchecked, needs, log_path)
      if missing:
        raise TaskImageError(f"task {name}: its image lacks what jaxes' agent protocol needs: "
                             f"{', '.join(missing)} (build FROM jaxes-sandbox:latest or add them; "
                             f"build log: {log_path})")
      image = self._cached(unchecked)
      self._check_size(name, image, unchecked)
      repository, _, version = tag.rpartition(":")
      image.tag(repository, version)
    finally:
      with open(log_path, "w", encoding="utf-8") as f:
        f.write("".join(lines))
      try:
        self.client.images.remove(unchecked, force=self._cached(tag) is None)
      except _errors():
        pass   # no such image: the build failed before tagging it
    return BuiltImage(tag, True, time.monotonic() - started, _workdir(image), _env(image),
                      log_path)

  def _probe(self, name: str, tag: str, needs: tuple[str, ...], log_path: str) -> list[str]:
    """What of ``needs`` (paths) and the agent's user the image lacks."""
    script = "; ".join(f"[ -x {path} ] || echo {shlex.quote('missing: ' + _NEEDS[path])}"
                       for path in needs) + _PROBE_USER
    try:
      # Not containers.run(remove=True): that leaves the anonymous volumes of a VOLUME behind.
      container = self.client.containers.create(tag, ["/bin/sh", "-c", script], entrypoint=[],
                                                network_mode="none", user="root")
      try:
        container.start()
        status = container.wait(timeout=120)["StatusCode"]
        out = container.logs(stdout=True, stderr=False)
        stderr = container.logs(stdout=False, stderr=True).decode(errors="replace")
      finally:
        container.remove(force=True, v=True)
    except _errors() as err:
      raise TaskImageError(f"task {name}: cannot start the built image {tag}: {err}") from err
    if status != 0:
      raise TaskImageError(f"task {name}: the built image cannot run /bin/sh (exit "
                           f"{status}: {' '.join(stderr.split())[:200]}); jaxes' agent "
                           f"protocol needs a shell (build log: {log_path})")
    return [line[len("missing: "):] for line in out.decode(errors="replace").splitlines()
            if line.startswith("missing: ")]


def _workdir(image) -> str:
  return (image.attrs.get("Config") or {}).get("WorkingDir") or "/"


def _env(image) -> tuple[tuple[str, str], ...]:
  pairs = ((entry.partition("=")[0], entry.partition("=")[2])
           for entry in (image.attrs.get("Config") or {}).get("Env") or ())
  return tuple(pairs)

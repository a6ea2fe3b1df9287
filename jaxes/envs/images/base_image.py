"""Builds the docker sandbox base image offline-from-hub: debootstrap + ``docker import``.

    python -m jaxes.envs.images.base_image build [--tag jaxes-sandbox:latest] [--force]

The root filesystem comes from ``debootstrap --variant=minbase`` of the host's own Debian
release, fetched from the mirror apt is already configured with (read from apt's sources at run
time, so no mirror is hard-coded). A non-root ``user`` (uid 1000, home /home/user) is created in
the root filesystem with ``chroot`` before the import. Needs root, debootstrap and an engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

DEFAULT_TAG = "jaxes-sandbox:latest"

# What tasks may rely on: a shell toolbox plus python3 and pytest for the final tests.
BASE_PACKAGES = (
  "bash", "coreutils", "findutils", "grep", "sed", "gawk", "procps", "file", "tar", "gzip",
  "bzip2", "xz-utils", "zip", "unzip", "python3", "python3-pytest", "python3-pip",
  "python3-venv", "git", "sqlite3", "diffutils", "patch", "less", "bc", "tree", "make",
  "passwd", "util-linux", "rsync", "curl", "wget", "ca-certificates", "cron", "hostname",
)
# Included only when the mirror has them (names differ between releases).
OPTIONAL_PACKAGES = ("jq", "vim-tiny", "nano")
# What debootstrap's minbase variant always contains besides the packages above.
MINBASE_PACKAGES = (
  "apt", "base-files", "base-passwd", "debianutils", "dpkg", "libc-bin", "login", "mawk",
  "ncurses-base", "ncurses-bin", "perl-base", "sysvinit-utils", "bsdutils", "mount",
)
# Python distributions importable in the image (python3-pytest and its dependencies, pip).
PYTHON_DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pip", "setuptools", "wheel")

SANDBOX_UID = 1000
SANDBOX_USER = "user"
SANDBOX_HOME = "/home/user"


@dataclasses.dataclass(frozen=True)
class AptSource:
  uri: str
  suites: tuple[str, ...]
  keyring: str | None


def _parse_one_line_sources(text: str) -> list[AptSource]:
  sources = []
  for line in text.splitlines():
    words = line.split("#", 1)[0].split()
    if not words or words[0] != "deb":
      continue
    words = words[1:]
    keyring = None
    if words and words[0].startswith("["):  # options, e.g. [signed-by=/x.gpg arch=amd64]
      options = []
      while words:
        word = words.pop(0)
        options.append(word.strip("[]"))
        if word.endswith("]"):
          break
      for option in options:
        if option.startswith("signed-by="):
          keyring = option.split("=", 1)[1]
    if len(words) >= 2:
      sources.append(AptSource(words[0], (words[1],), keyring))
  return sources


def _parse_deb822_sources(text: str) -> list[AptSource]:
  sources = []
  for stanza in text.split("\n\n"):
    fields = {}
    for line in stanza.splitlines():
      if line.startswith("#") or ":" not in line or line[:1].isspace():
        continue
      key, value = line.split(":", 1)
      fields[key.strip().lower()] = value.strip()
    if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
      continue
    suites = tuple(fields.get("suites", "").split())
    for uri in fields.get("uris", "").split():
      sources.append(AptSource(uri, suites, fields.get("signed-by")))
  return sources


def apt_sources(root: str = "/etc/apt") -> list[AptSource]:
  """Every ``deb`` source apt is configured with, in apt's reading order."""
  sources = []
  main_list = os.path.join(root, "sources.list")
  if os.path.exists(main_list):
    with open(main_list) as f:
      sources += _parse_one_line_sources(f.read())
  for path in sorted(glob.glob(os.path.join(root, "sources.list.d", "*"))):
    with open(path) as f:
      text = f.read()
    if path.endswith(".list"):
      sources += _parse_one_line_sources(text)
    elif path.endswith(".sources"):
      sources += _parse_deb822_sources(text)
  return sources


def host_suite(os_release: str = "/etc/os-release") -> str:
  with open(os_release) as f:
    for line in f:
      if line.startswith("VERSION_CODENAME="):
        return line.split("=", 1)[1].strip().strip('"')
  raise RuntimeError(f"{os_release}: no VERSION_CODENAME; is this Debian?")


def mirror_for(suite: str, sources: list[AptSource]) -> AptSource:
  """The first configured source that serves ``suite`` itself (not -security/-updates)."""
  for source in sources:
    if suite in source.suites:
      return source
  raise RuntimeError(
    f"no apt source in /etc/apt/sources.list or /etc/apt/sources.list.d/ serves suite "
    f"{suite!r}; configure one (the image is built from apt's own mirror)")


def _available(package: str) -> bool:
  return subprocess.run(["apt-cache", "show", package], capture_output=True).returncode == 0


def _run(cmd: list[str], log) -> None:
  log("$ " + " ".join(cmd))
  result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  if result.returncode != 0:
    tail = "\n".join(result.stdout.splitlines()[-30:])
    raise RuntimeError(f"command failed ({result.returncode}): {' '.join(cmd)}\n{tail}")


def image_exists(client, tag: str) -> bool:
  import docker
  try:
    client.images.get(tag)
    return True
  except docker.errors.ImageNotFound:
    return False


def build(tag: str = DEFAULT_TAG, force: bool = False, log=print) -> float:
  """Builds ``tag`` unless it exists (or ``force``). Returns the seconds the build took."""
  import docker
  client = docker.from_env()
  if image_exists(client, tag) and not force:
    log(f"image {tag} exists; nothing to do (--force rebuilds)")
    return 0.0
  if os.geteuid() != 0:
    raise RuntimeError("building the base image needs root (debootstrap, chroot)")
  if shutil.which("debootstrap") is None:
    raise RuntimeError("debootstrap not found; apt-get install -y debootstrap")
  start = time.monotonic()
  suite = host_suite()
  source = mirror_for(suite, apt_sources())
  packages = list(BASE_PACKAGES) + [p for p in OPTIONAL_PACKAGES if _available(p)]
  log(f"building {tag}: debian {suite} minbase from apt's configured mirror, "
      f"{len(packages)} packages")
  workdir = tempfile.mkdtemp(prefix="jaxes-image-", dir="/var/tmp")
  try:
    rootfs = os.path.join(workdir, "rootfs")
    cmd = ["debootstrap", "--variant=minbase", "--include=" + ",".join(packages)]
    if source.keyring:
      cmd.append("--keyring=" + source.keyring)
    _run(cmd + [suite, rootfs, source.uri], log)
    log(f"debootstrap done after {time.monotonic() - start:.0f} s; adding user {SANDBOX_USER}")
    _run(["chroot", rootfs, "useradd", "--create-home", "--home-dir", SANDBOX_HOME,
          "--uid", str(SANDBOX_UID), "--shell", "/bin/bash", SANDBOX_USER], log)
    # Package caches only make the image bigger; apt cannot reach a mirror inside the sandbox.
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "var/log/*.log"):
      for path in glob.glob(os.path.join(rootfs, pattern)):
        if os.path.isfile(path):
          os.remove(path)
    tarball = os.path.join(workdir, "rootfs.tar")
    _run(["tar", "--numeric-owner", "-C", rootfs, "-cf", tarball, "."], log)
    repository, _, version = tag.partition(":")
    log(f"docker import -> {tag}")
    client.api.import_image_from_file(
      tarball, repository=repository, tag=version or "latest",
      changes=["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "ENV LANG=C.UTF-8", f"WORKDIR {SANDBOX_HOME}", 'CMD ["bash"]',
               "LABEL jaxes.image=sandbox"])
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  _smoke_test(client, tag, log)
  seconds = time.monotonic() - start
  log(f"built {tag} in {seconds:.0f} s")
  return seconds


def _smoke_test(client, tag: str, log) -> None:
  output = client.containers.run(
    tag, ["bash", "-lc", "id -u user && python3 -m pytest --version && jq --version || true"],
    remove=True, network_mode="none", stderr=True)
  log("smoke test: " + output.decode(errors="replace").strip().replace("\n", "; "))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxes.envs.images.base_image")
  sub = parser.add_subparsers(dest="command", required=True)
  build_parser = sub.add_parser("build", help="build the sandbox base image if absent")
  build_parser.add_argument("--tag", default=DEFAULT_TAG)
  build_parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
  args = parser.parse_args(argv)
  try:
    build(args.tag, force=args.force, log=lambda msg: print(msg, flush=True))
  except RuntimeError as err:
    print(f"image build failed: {err}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())

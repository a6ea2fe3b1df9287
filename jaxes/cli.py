"""What every jaxes command does alike: a quiet start of JAX, ``--help`` that exits 0, and a usage
error as one line with exit status 2 (1 stays "the command ran and the answer is no": a config
that does not fit, runs that differ).

A quiet start (``start_jax``): where ``JAX_PLATFORMS`` is unset and the machine has no accelerator
(no NVIDIA, AMD or TPU device file), the platform is set to ``cpu`` before JAX initialises a
backend. Then JAX does not initialise the CUDA and TPU plugins that the ``[gpu-aot]`` and ``[tpu]``
extras install (a CUDA traceback and TPU warnings on every start, and programs compiled under
another backend set than a run with ``JAX_PLATFORMS=cpu``, so the two miss each other's compile
cache). What the CUDA plugin's libraries still log while ``import jax`` loads them (absl's
"Could not find cuda drivers" lines, on any platform) is dropped; every other line is kept.
JAX offers no setting for either: its plugin discovery and CUDA kernel imports are unconditional.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile

USAGE = 2   # exit status of a command line that cannot run (argparse's and absl's convention)

HELP_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")

# Device files of the accelerators JAX has plugins for (NVIDIA, AMD ROCm, TPU VMs' /dev/accel*
# and, from v5 on, /dev/vfio/N).
_ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
# Lines the CUDA plugin's libraries log while they load, with or without a GPU.
PLUGIN_NOISE = re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are "
                          r"written to STDERR$|cudart_stub\.cc:\d+\] Could not find cuda drivers")

platform_note: str | None = None   # what set_up_platform chose, for a run's log (None: nothing)


def usage_error(prog: str, message: str):
  """``prog: message`` on stderr, exit status 2."""
  print(f"{prog}: {message}", file=sys.stderr)
  sys.exit(USAGE)


def wants_help(argv) -> bool:
  return any(a in HELP_FLAGS for a in argv[1:])


def accelerator_present(patterns=_ACCELERATOR_FILES) -> bool:
  return any(glob.glob(p) for p in patterns)


def set_up_platform(environ=os.environ, accelerator: bool | None = None) -> str | None:
  """Sets ``JAX_PLATFORMS=cpu`` where it is unset and no accelerator is present; returns the
  sentence saying so (also kept in ``platform_note``), or None when it set nothing."""
  global platform_note
  if environ.get("JAX_PLATFORMS") or (accelerator_present() if accelerator is None else accelerator):
    return None
  environ["JAX_PLATFORMS"] = "cpu"
  platform_note = ("platform: cpu (no accelerator found, so jaxes set JAX_PLATFORMS=cpu; set it "
                   "yourself to choose)")
  return platform_note


@contextlib.contextmanager
def without_plugin_noise():
  """Within the block, what reaches file descriptor 2 (C++ logging writes there directly) goes to
  a temporary file; at its end every line but ``PLUGIN_NOISE`` is written on to stderr. For short
  blocks on the main thread (an import, a backend's start), not for a run."""
  sys.stderr.flush()
  original = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(original, 2)
      os.close(original)
      caught.seek(0)
      kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
              if not PLUGIN_NOISE.search(line)]
      if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def start_jax(init_backends: bool = True):
  """``set_up_platform``, then ``import jax`` (and, with ``init_backends``, its backends' start)
  without the plugins' noise; returns the module. A multi-process run starts its backends only
  after ``jax.distributed.initialize`` (``init_backends=False``, then ``start_backends``)."""
  set_up_platform()
  with without_plugin_noise():
    import jax
  if init_backends:
    start_backends()
  return jax


def start_backends() -> None:
  with without_plugin_noise():
    import jax
    jax.devices()

"""What a command may do to a run directory before it writes there: set the previous run aside
(``--restart``), and refuse a directory that holds another command's files or cannot be written.
Plain os and json: it runs before JAX is imported.
"""
from __future__ import annotations

import json
import os
import time

# What --restart leaves in place: earlier set-aside runs and the compiled programs (a cache, keyed
# by program: a fresh run reads what fits it).
KEPT_BY_RESTART = ("restarted-", "compile-cache")


def restart(workdir: str) -> str | None:
  """Moves every file of the directory's previous run (all but ``KEPT_BY_RESTART``) into
  ``workdir/restarted-<UTC time>/``; returns that path (None if there was nothing)."""
  present = [n for n in os.listdir(workdir) if not n.startswith(KEPT_BY_RESTART)]
  if not present:
    return None
  base = os.path.join(workdir, time.strftime("restarted-%Y%m%dT%H%M%SZ", time.gmtime()))
  aside, n = base, 1
  while os.path.exists(aside):   # two restarts within a second
    aside, n = f"{base}.{n}", n + 1
  os.makedirs(aside)
  for name in present:
    os.rename(os.path.join(workdir, name), os.path.join(aside, name))
  return aside


def foreign_config(workdir: str) -> str | None:
  """Why ``workdir``'s ``config.json`` is not a training run's (an exported Hugging Face model's,
  say), or None: training would overwrite it, or fail to read it as the run's config."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      stored = json.load(f)
  except (OSError, ValueError) as e:
    return f"its config.json cannot be read as a run's config ({type(e).__name__})"
  if isinstance(stored, dict) and {"model", "train", "env"} <= set(stored):
    return None
  kind = " (a Hugging Face model's)" if isinstance(stored, dict) and "model_type" in stored else ""
  return f"its config.json was not written by python -m jaxes.train{kind}"


def unwritable(workdir: str) -> str | None:
  """Why nothing can be written in ``workdir``, or None (tried, not guessed from the mode bits:
  root may write where the bits say no, and a read-only mount refuses root too)."""
  probe = os.path.join(workdir, f".jaxes-write-probe-{os.getpid()}")
  try:
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    return e.strerror
  return None

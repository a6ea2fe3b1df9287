"""A tiny training config, its tokenizer and a config file for `python -m jaxes.train`."""
import os
import pathlib
import signal
import subprocess
import sys
import time

from helpers_repo import REPO
from jaxes import tokenization
from jaxes.envs.tasks import generator
from jaxes.train import metrics
from jaxes.train.config import load_config_file

ROOT = REPO
FAMILIES = "permissions,log_count"
SYSTEM = "Answer with <command>CMD</command>, then <action>done</action>."


def build_tiny_tokenizer(out: str) -> str:
  tasks = [generator.generate(f, s, 1) for f in FAMILIES.split(",") for s in range(4)]
  texts = 16 * [SYSTEM] + [t.instruction for t in tasks] + [t.solution for t in tasks]
  tokenization.build_tokenizer(texts, 400, out)
  return out


def tiny_config(tokenizer_dir, **overrides):
  c = load_config_file(ROOT / "configs" / "demo.py")
  c.tokenizer.path = tokenizer_dir
  c.mesh.data = 1   # one device, whatever XLA_FLAGS fakes (the multi-device tests set their mesh)
  c.model.vocab_size = 400
  c.model.hidden_size, c.model.intermediate_size, c.model.num_layers = 32, 64, 1
  c.model.num_heads, c.model.num_kv_heads = 2, 1
  c.es.population, c.es.sigma, c.es.learning_rate = 4, 0.005, 0.01
  c.controller.episodes_per_member = 1
  c.env.families, c.env.difficulty, c.env.max_turns = FAMILIES, 1, 2
  c.env.system_prompt = SYSTEM
  c.env.num_train_tasks, c.env.num_heldout_tasks, c.env.sandbox_workers = 8, 4, 2
  c.rollout.num_slots, c.rollout.max_len, c.rollout.prefill_chunk = 4, 192, 64
  c.rollout.max_new_tokens = 24
  c.train.num_updates, c.train.eval_every, c.train.checkpoint_every = 2, 0, 1
  c.train.progress_bar = False
  # Programs compile when first called: a few-update test uses a fraction of the 29 the start-up
  # compile would build (2.5x the CPU of test_train's first test; tests/train/test_precompile.py covers it).
  c.train.compile_jobs = 0
  c.eval.num_tasks, c.eval.seeds = 2, 1
  c.eval.drift = False   # its programs' compile (~10 s): on in the tests that check it
  c.warmstart.steps, c.warmstart.num_tasks, c.warmstart.batch_size = 0, 8, 4
  c.warmstart.seq_len = 160
  c.warmstart.off_protocol_fraction = 0.0   # warm starts here must follow the protocol
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


def write_config_file(config, path) -> str:
  """A config file whose get_config() returns ``config`` (for the command-line entry point)."""
  pathlib.Path(path).write_text(
      "import json\nfrom ml_collections import config_dict\n\n\n"
      f"def get_config():\n  return config_dict.ConfigDict(json.loads({config.to_json()!r}))\n")
  return str(path)


def launch_env(tmp, **extra) -> dict:
  """The environment of a launched training process: this one's, less any JAX / SLURM / jaxes
  settings (the launch sets its own), on CPU, with a compilation cache that every launch shares
  (later launches load their programs instead of compiling them)."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "SLURM_", "JAXES_", "XLA_FLAGS"))}
  # The suite's compile flags (tests/conftest.py: optimisation level 0, XLA:CPU's older emitters;
  # ~40% less CPU per launch), not its device count, which each launch sets. Both sides of a
  # cross-layout comparison compile the same per-device program with the same flags, so the
  # bits a comparison checks do not depend on them.
  compile_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count")]
  extra["XLA_FLAGS"] = " ".join(compile_flags + extra.get("XLA_FLAGS", "").split())
  # The suite's cache (tests/conftest.py) where there is one: launches of other tests with the
  # same shapes and device counts then load their programs too.
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(pathlib.Path(tmp) / "jax-cache")
  env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONUNBUFFERED="1", **extra)
  return env


def train_records(workdir) -> list[dict]:
  """The metrics lines of ``workdir``'s updates (none before its first)."""
  path = os.path.join(workdir, "metrics.jsonl")
  return [r for r in metrics.read_metrics(path) if "train" in r] if os.path.exists(path) else []


class InjectedFailure(Exception):
  """The failure a test injects into a run after an update, in place of a SIGKILL."""


def fail_after_update(config, workdir, version: int = 1) -> None:
  """Runs ``config`` in ``workdir`` in this process and fails it (an exception from a hook) right
  after update ``version``'s metrics line, checkpoint and update-log record are written: the
  in-process twin of ``sigkill_after_first_update``, for tests whose subject is the run state a
  rerun resumes from, not the process's death (that is the end-to-end tier's)."""
  from jaxes.train.hooks import Hook
  from jaxes.train.trainer import Trainer

  def fail(info):
    if info.version == version:
      raise InjectedFailure(f"injected after update {version}")
  try:
    Trainer(config, str(workdir), log=lambda s: None, hooks=[Hook(fail)]).run()
  except InjectedFailure:
    pass
  else:
    raise AssertionError(f"the run ended before update {version}: nothing was interrupted")
  assert len(train_records(workdir)) == version < config.train.num_updates


def sigkill_after_first_update(config, workdir, config_path) -> list[str]:
  """Launches ``python -m jaxes.train`` on ``config`` in ``workdir``, SIGKILLs it as soon as its
  first update's metrics line is written (mid-run: fails if the run ended first) and returns the
  command, to rerun it. The kill lands wherever the run is then (engine step, sandbox, checkpoint
  write), which is what a resume must survive."""
  cmd = [sys.executable, "-m", "jaxes.train", f"--config={write_config_file(config, config_path)}",
         f"--workdir={workdir}"]
  kill_when(cmd, lambda: bool(train_records(workdir)), pathlib.Path(config_path).with_suffix(".stderr"))
  assert 1 <= len(train_records(workdir)) < config.train.num_updates
  return cmd


def kill_when(cmd, ready, stderr_path, delay: float = 0.0) -> int:
  """Launches ``cmd`` and SIGKILLs it ``delay`` seconds after ``ready()`` first holds (or after
  300 s); fails if it ended before. Returns its pid. Its stderr goes to ``stderr_path``, not a
  pipe: a chatty run would fill an unread pipe and block."""
  with open(stderr_path, "wb") as err:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    time.sleep(delay)
    ended = proc.poll() is not None
    if not ended:
      os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  assert not ended, f"the run ended before it could be killed:\n{pathlib.Path(stderr_path).read_text()[-2000:]}"
  return proc.pid

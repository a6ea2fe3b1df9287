"""EpisodeRunner: with ``sandbox_steps > 0`` the schedule (which rows share each engine call) and
so every episode is the same however long the sandbox takes; common random numbers give
antithetic partners one sampling stream."""
import os
import random
import shutil
import tempfile
import time

import pytest
from flax import nnx

from jaxes import tokenization
from jaxes.controller.controller import Job
from jaxes.envs import protocol
from jaxes.envs.sandboxes.local_sandbox import LocalSandbox
from jaxes.envs.sandboxes.sandbox import Sandbox, SandboxHandle
from jaxes.envs.tasks import generator
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeRunner, EpisodeSpec
from jaxes.train.algorithms.evolution import PAIR_STREAM_BASE, training_stream

SYSTEM = "Answer with <command>CMD</command>, then <action>done</action>."


class _SlowHandle(SandboxHandle):
  def __init__(self, inner, rng):
    self.inner, self.rng = inner, rng

  def _pause(self):
    time.sleep(self.rng.uniform(0.0, 0.03))

  def exec(self, command, timeout_s):
    self._pause()
    return self.inner.exec(command, timeout_s)

  def run_tests(self):
    self._pause()
    return self.inner.run_tests()

  def close(self):
    self.inner.close()


class SlowSandbox(Sandbox):
  """A real local sandbox whose every operation first sleeps a random 0-30 ms."""

  def __init__(self, inner, seed):
    self.inner, self.rng = inner, random.Random(seed)

  def start(self, task):
    time.sleep(self.rng.uniform(0.0, 0.03))
    return _SlowHandle(self.inner.start(task), self.rng)

  def shutdown(self):
    self.inner.shutdown()


@pytest.fixture(scope="module")
def setup():
  tasks = [generator.generate(f, s, 1) for f in ("permissions", "log_count") for s in range(3)]
  tok_dir = tempfile.mkdtemp(prefix="test-tok-")
  tok = tokenization.build_tokenizer(16 * [SYSTEM] + [t.instruction for t in tasks], 400, tok_dir)
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                 num_layers=1, num_heads=2, num_kv_heads=1)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  root = tempfile.mkdtemp(prefix="test-episodes-")
  os.chmod(root, 0o711)  # the sandbox uid must traverse it
  yield tasks, tok, cfg, graphdef, params, os.path.join(root, "sandboxes")
  shutil.rmtree(root, ignore_errors=True)
  shutil.rmtree(tok_dir, ignore_errors=True)


def _run(setup, delay_seed: int, sandbox_steps: int):
  """Six sampled episodes on three slots; returns (transcripts, per-step slot states)."""
  tasks, tok, cfg, graphdef, params, root = setup
  sandbox = SlowSandbox(LocalSandbox(root_dir=root), delay_seed)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  engine = Engine(graphdef, cfg, num_slots=3, max_len=256, prefill_chunk=32, max_new_tokens=12,
                  stop_ids=[], im_end_id=im_end)
  episodes = {}

  def make_episode(task, handle):
    episodes[task.family, task.seed] = protocol.Episode(task, handle, system_prompt=SYSTEM)
    return episodes[task.family, task.seed]

  runner = EpisodeRunner(engine, tok, sandbox, make_episode=make_episode, workers=4,
                         sandbox_steps=sandbox_steps)
  todo = [EpisodeSpec(i, task, 0, -1, stream=i, temperature=1.0) for i, task in enumerate(tasks)]
  todo.reverse()
  schedule, done = [], 0
  try:
    while done < len(tasks):
      for _ in runner.free_slots()[:len(todo)]:
        runner.submit(todo.pop())
      schedule.append(tuple((s.index, s.state, s.length) for s in engine.scheduler.slots))
      done += len(runner.poll({0: params}, block=True))
  finally:
    runner.close()
    sandbox.shutdown()
  return {k: e.messages for k, e in episodes.items()}, schedule


def test_deterministic_schedule_does_not_depend_on_sandbox_timing(setup):
  transcripts, schedule = _run(setup, delay_seed=1, sandbox_steps=2)
  again, schedule_again = _run(setup, delay_seed=2, sandbox_steps=2)
  assert len(transcripts) == 6 and all(len(m) >= 3 for m in transcripts.values())
  assert schedule == schedule_again
  assert transcripts == again


def test_negative_sandbox_steps_is_an_error(setup):
  tasks, tok, cfg, graphdef, params, root = setup
  engine = Engine(graphdef, cfg, num_slots=1, max_len=64, prefill_chunk=8, max_new_tokens=4,
                  stop_ids=[], im_end_id=0)
  with pytest.raises(ValueError, match="sandbox_steps"):
    EpisodeRunner(engine, tok, None, make_episode=None, workers=1, sandbox_steps=-1)


def test_common_random_numbers_share_a_stream_within_an_antithetic_pair():
  def job(job_id, version, member, episode=0):
    return Job(job_id, version, member, task=7, episode=episode, attempt=0)

  plus, minus = job(10, 3, 4), job(11, 3, 5)
  assert training_stream(plus, True, True) == training_stream(minus, True, True) >= PAIR_STREAM_BASE
  others = {training_stream(j, True, True) for j in (job(12, 3, 6), job(13, 4, 4), job(14, 3, 4, 1))}
  assert training_stream(plus, True, True) not in others and len(others) == 3
  # A reissued job (new id, same version/member/episode) decodes with the same stream.
  assert training_stream(job(99, 3, 4), True, True) == training_stream(plus, True, True)
  # Off: every job samples on its own stream (its id).
  assert [training_stream(j, True, False) for j in (plus, minus)] == [10, 11]
  assert training_stream(plus, False, True) == 10

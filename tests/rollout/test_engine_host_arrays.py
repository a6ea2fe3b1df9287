"""The engine's host arrays and the device: what a step places is a copy, so the scheduler may
write its arrays in place while the device has not yet run the programs that read them.

On CPU ``jax.device_put`` of a 64-byte-aligned numpy array shares its memory, and programs queue
behind device work still in flight (an ES update dispatched beside the rollouts). The engine used
to place its reset flags as they were and clear them right after dispatch; with the flags aligned
and the device busy the clear won, a re-started row kept its old episode's cache, and resumed
training runs differed from uninterrupted ones in one process out of a few (the alignment of one
small allocation decides)."""
import jax
import jax.numpy as jnp
import numpy as np

from helpers_models import tiny_model
from jaxes.rollout.engine import Engine

SLOTS = 8


def _turns(engine, params, prompt, stream):
  for slot in range(SLOTS):
    engine.scheduler.start(slot, prompt, version=0, member=-1, stream=stream)
  turns = {}
  while len(turns) < SLOTS:
    turns.update({t.slot: list(t.tokens) for t in engine.step({0: params})})
  for slot in range(SLOTS):
    engine.scheduler.release(slot)
  return turns


def _aligned_flags(n: int) -> np.ndarray:
  """``n`` bools at a 64-byte boundary: the case ``device_put`` shares instead of copying."""
  buffer = np.zeros(n + 64, bool)
  start = -buffer.ctypes.data % 64
  return buffer[start:start + n]


def test_a_restarted_row_is_reset_while_the_device_is_busy():
  cfg, graphdef, params = tiny_model(vocab_size=64)

  def engine():
    return Engine(graphdef, cfg, num_slots=SLOTS, max_len=64, prefill_chunk=8, max_new_tokens=5,
                  stop_ids=[], im_end_id=3)

  fresh = _turns(engine(), params, [5, 6, 7], stream=1)
  reused = engine()
  reused.scheduler.to_reset = _aligned_flags(SLOTS)
  other_work = jax.jit(lambda x: x @ x @ x @ x)
  square = jnp.ones((600, 600))
  other_work(square).block_until_ready()
  for _ in range(3):
    _turns(reused, params, list(range(5, 17)), stream=0)   # every row holds a longer episode
    in_flight = other_work(square)                          # queued ahead of the next reset
    assert _turns(reused, params, [5, 6, 7], stream=1) == fresh
    in_flight.block_until_ready()

"""The engine's host-side scheduler (``jaxes.rollout.scheduler``), without JAX: a step's rows and
the tokens each feeds, the prefill hold, version groups, sampling limits, pages taken, refused
and returned, and what a call's sampled tokens do to a row (on this process or another's)."""
import subprocess
import sys

import pytest

from jaxes.rollout.scheduler import DECODE, FREE, PAGES_EXHAUSTED, PARKED, PREFILL, Scheduler

IM_END, STOP = 3, 7


def scheduler(**kw):
  args = dict(num_slots=4, shards=2, max_len=32, prefill_chunk=4, max_new_tokens=3,
              stop_ids=[STOP], im_end_id=IM_END, buckets=[1, 2, 6], decode_steps=2,
              prefill_hold=2)
  return Scheduler(**{**args, **kw})


def decoding(s, index, version=0):
  """Slot ``index`` started with a 2-token prompt and fed it (now decoding, one token sampled)."""
  assert s.start(index, [10, 11], version=version, member=index, stream=index)
  s.fed(s.slots[index], 2, [20], [-0.5], [])
  assert s.slots[index].state == DECODE


@pytest.mark.end_to_end
def test_the_scheduler_imports_no_jax():
  code = "import sys, jaxes.rollout.scheduler; sys.exit('jax' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_pack_feeds_decode_tokens_first_and_cuts_prefills_to_the_largest_bucket():
  s = scheduler()
  decoding(s, 0)
  for i in (1, 2, 3):
    assert s.start(i, list(range(10, 19)), version=0, member=i, stream=i)   # 9-token prompts
  fed = s.pack(s.slots)
  # shard 0 (slots 0, 1): 1 decode token + 5 of a chunk of 4 -> 4; shard 1: two chunks, 6 room
  assert fed == {0: 1, 1: 4, 2: 4, 3: 2}
  assert s.bucket(fed) == 6 and s.bucket({0: 1}) == 1 and s.bucket({0: 1, 1: 1}) == 2
  assert s.limit(s.slots[1], 4) == 0          # its prompt goes on next call: samples nothing
  assert s.limit(s.slots[0], 1) == 2          # decode_steps


def test_a_new_prefill_waits_beside_decoding_rows_then_goes():
  s = scheduler(num_slots=8, buckets=[2, 4, 8])   # the smallest bucket: 2 samples per shard
  decoding(s, 0)
  assert s.start(4, [10, 11, 12], version=0, member=4, stream=4)
  assert [r.index for r in s.working()] == [0]   # held: step 1
  assert [r.index for r in s.working()] == [0]   # step 2
  assert [r.index for r in s.working()] == [0, 4]  # waited prefill_hold steps: it goes
  assert s.stats.prefill_held == 2
  assert s.start(5, [10], version=0, member=5, stream=5)
  assert s.start(6, [10], version=0, member=6, stream=6)
  assert [r.index for r in s.working()] == [0, 4, 5, 6]   # two new ones fill the bucket: go
  # Nothing else decoding: a prefill never waits.
  t = scheduler()
  assert t.start(1, [10, 11], version=0, member=1, stream=1)
  assert [r.index for r in t.working()] == [1]
  assert scheduler(prefill_hold=0).held(s.slots) == []


def test_versions_share_a_call_only_with_their_steps_registered():
  s = scheduler(max_steps=2)
  assert s.groups([0, 1, 2, 5], stepped={1, 2, 5}) == [(0, 1, 2), (5,)]
  assert s.groups([0, 1, 2], stepped={2}) == [(0,), (1, 2)]
  assert scheduler().groups([0, 1], stepped={1}) == [(0,), (1,)]   # no version steps


def test_a_turn_ends_at_a_stop_id_or_its_budget_and_is_closed_for_the_observation():
  s = scheduler()
  decoding(s, 0)
  finished = []
  s.fed(s.slots[0], 1, [21, STOP], [-1.0, -2.0], finished)
  (turn,) = finished
  assert (turn.tokens, turn.logprobs, turn.stopped) == ([20, 21, STOP], [-0.5, -1.0, -2.0], True)
  assert s.slots[0].state == PARKED and s.slots[0].length == 4
  assert s.continue_turn(0, [30, 31])
  assert s.slots[0].pending == [STOP, IM_END, 30, 31]   # not <|im_end|>: closed with one
  decoding(s, 1)
  finished = []
  s.fed(s.slots[1], 1, [21, 22], [-1.0, -1.0], finished)   # max_new_tokens = 3
  assert finished[0].stopped is False and finished[0].tokens == [20, 21, 22]


def test_a_turn_may_move_a_row_to_newer_weights_keeping_its_members_noise():
  s = scheduler()
  decoding(s, 0, version=1)
  s.fed(s.slots[0], 1, [21, STOP], [-1.0, -2.0], [])
  with pytest.raises(ValueError, match="goes back from version 1"):
    s.continue_turn(0, [30], version=0)
  assert s.slots[0].state == PARKED   # refused: nothing changed
  assert s.continue_turn(0, [30], version=3)
  assert (s.slots[0].version, s.slots[0].noise_version, s.slots[0].member) == (3, 1, 0)
  assert s.live_versions() == {3}
  sliced = scheduler(member_slices=True)
  decoding(sliced, 0)
  sliced.fed(sliced.slots[0], 1, [21, STOP], [-1.0, -2.0], [])
  with pytest.raises(ValueError, match="under member_slices a data shard runs one"):
    sliced.continue_turn(0, [30], version=1)
  assert sliced.continue_turn(0, [30], version=0)   # its own version: no change


def test_another_processs_row_takes_the_same_decisions_from_its_count_and_last_token():
  mine, theirs = scheduler(), scheduler(readable=[0, 1])
  for s in (mine, theirs):
    for i in (2, 3):
      decoding(s, i)
  finished = {id(s): [] for s in (mine, theirs)}
  mine.fed(mine.slots[2], 1, [21, IM_END], [-1.0, -2.0], finished[id(mine)])
  theirs.fed(theirs.slots[2], 1, [-1, IM_END], [float("nan")] * 2, finished[id(theirs)])
  (a,), (b,) = finished[id(mine)], finished[id(theirs)]
  assert a.tokens == [20, 21, IM_END] and (b.tokens, b.logprobs) == (None, None)
  assert a.stopped == b.stopped is True
  for s in (mine, theirs):
    assert s.continue_turn(2, [30])
  assert mine.slots[2].pending == theirs.slots[2].pending == [IM_END, 30]
  assert mine.slots[2].length == theirs.slots[2].length


def test_pages_are_taken_as_rows_grow_refused_when_out_and_all_returned():
  s = scheduler(page_size=4, num_pages=4)   # 2 pages per shard
  assert s.can_start(0, 8) and s.can_start(0, 9)   # 3 pages never fit a shard: start refuses
  assert not s.start(0, list(range(10, 19)), version=0, member=0, stream=0)
  assert s.start(0, [10, 11, 12, 13], version=0, member=0, stream=0)
  assert s.pool.in_use(0) == 1 and s.table_changed and s.to_reset[0]
  s.fed(s.slots[0], 4, [20], [-0.5], [])
  assert s.start(1, [10, 11, 12, 13], version=0, member=1, stream=1)   # the shard's last page
  assert not s.can_start(1, 1) and s.free_slots() == [2, 3]
  finished = []
  s.page_decoding_rows(finished)   # slot 0's next token starts a page: none is free
  assert [(t.slot, t.failure) for t in finished] == [(0, PAGES_EXHAUSTED)]
  assert s.slots[0].state == PARKED and not s.continue_turn(0, [30])
  s.release(0)
  s.release(1)
  assert s.pool.in_use() == 0 and s.slots[0].state == FREE and s.slots[1].state == FREE


def test_bad_calls_are_clear_errors():
  s = scheduler(member_slices=True)
  assert s.start(0, [10], version=0, member=5, stream=0)
  with pytest.raises(ValueError, match="slot 0 is prefill, not free"):
    s.start(0, [10], version=0, member=5, stream=0)
  with pytest.raises(ValueError, match=r"runs \(version, member\) \(0, 5\), not \(0, 6\)"):
    s.start(1, [10], version=0, member=6, stream=1)
  with pytest.raises(ValueError, match="slot 1 is free, not parked"):
    s.continue_turn(1, [30])
  assert s.slots[0].state == PREFILL

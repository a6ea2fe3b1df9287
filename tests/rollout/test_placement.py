"""Placement: an engine's host arrays on its mesh, rows split over ``data`` (each data shard the
contiguous block of its index, whole on the fsdp/tensor devices beside it) or replicated; placed
as copies (the scheduler writes its arrays in place after the call); one process reads all rows.
The multi-process branches (``make_array_from_callback``, partial ``readable``/``own_rows``) run
in tests/rollout/test_engine_multiprocess.py's launched processes."""
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxes import sharding
from jaxes.rollout.placement import Placement

SLOTS = 8


@pytest.fixture(scope="module")
def placement():
  return Placement(sharding.make_mesh(4, 2, 1), SLOTS, param_shardings=None)


def test_rows_split_over_data_and_replicated_is_whole(placement):
  assert placement.shards == 4
  assert placement.rows.spec == PartitionSpec("data") and placement.rows.mesh is placement.mesh
  assert placement.replicated.spec == PartitionSpec()


def test_by_rows_gives_each_data_shard_its_block_of_rows(placement):
  tokens = np.arange(SLOTS * 3, dtype=np.int32).reshape(SLOTS, 3)
  counters = np.arange(SLOTS, dtype=np.uint32) * 10
  placed_tokens, placed_counters = placement.by_rows(tokens, counters)
  for placed, host in ((placed_tokens, tokens), (placed_counters, counters)):
    assert placed.sharding == placement.rows and placed.dtype == host.dtype
    np.testing.assert_array_equal(np.asarray(placed), host)
    data_index = {d: i for i, row in enumerate(placement.mesh.devices) for d in row.flat}
    assert len(placed.addressable_shards) == 8   # 4 blocks, each on both fsdp devices
    for shard in placed.addressable_shards:
      block = data_index[shard.device]
      np.testing.assert_array_equal(np.asarray(shard.data), host[2 * block:2 * block + 2])


def test_everywhere_and_put_replicate_whole_arrays(placement):
  (key,) = placement.everywhere(np.array([7, 9], np.uint32))
  assert key.sharding == placement.replicated
  assert all(np.array_equal(np.asarray(s.data), [7, 9]) for s in key.addressable_shards)
  limit = placement.put(np.full(SLOTS, 3, np.int32), placement.rows)
  assert limit.sharding == placement.rows and np.asarray(limit).tolist() == [3] * SLOTS


def test_placed_arrays_are_copies_of_the_hosts(placement):
  host = np.zeros(SLOTS, np.int32)
  (placed,) = placement.by_rows(host)
  (whole,) = placement.everywhere(host)
  host[:] = 5   # the scheduler writes its arrays in place after a dispatched call
  assert np.asarray(placed).tolist() == [0] * SLOTS and np.asarray(whole).tolist() == [0] * SLOTS


def test_one_process_reads_and_owns_every_row(placement):
  assert placement.readable() == frozenset(range(SLOTS))
  abstract = Placement(placement.mesh, SLOTS, None, abstract=True)
  assert abstract.readable() == frozenset(range(SLOTS))
  tokens = np.arange(SLOTS, dtype=np.int32) + 1
  (placed,) = placement.by_rows(tokens)
  own = placement.own_rows(placed, fill=-1)
  assert isinstance(own, np.ndarray) and own.tolist() == tokens.tolist()


"""What an implementation reads (``jaxes.models.attention.keys``): a bounded read's key block
per platform, which slots a query sees, how far a bounded read goes, key blocks of whole pages."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes.models.attention import keys
from jaxes.models.attention.keys import Addressing, KeyView


def test_a_bounded_read_takes_the_platforms_key_block_where_it_tiles_the_span():
  bounded = Addressing(None, None, span=256, bounded=True)
  assert keys.BOUNDED_KV_BLOCK == {"cpu": 64}
  assert bounded.for_platform("cpu").block == 64
  assert bounded.for_platform("tpu") is bounded and bounded.for_platform("gpu") is bounded
  assert Addressing(None, None, span=48, bounded=True).for_platform("cpu").block == 64
  assert Addressing(None, None, span=200, bounded=True).for_platform("cpu").block is None
  assert Addressing(None, None, span=256, bounded=True, block=16).for_platform("cpu").block == 16
  assert Addressing(None, None, span=256).for_platform("cpu").block is None   # unbounded


def test_a_query_sees_the_valid_slots_up_to_its_own():
  valid = jnp.asarray([[True, True, False, True], [True, True, True, True]])
  q_slots = jnp.asarray([[1, 3], [0, 2]], jnp.int32)
  view = KeyView(lambda start, n: None, Addressing(valid, q_slots, span=4))
  np.testing.assert_array_equal(view.visible(0, 4), [
      [[1, 1, 0, 0], [1, 1, 0, 1]], [[1, 0, 0, 0], [1, 1, 1, 0]]])
  np.testing.assert_array_equal(view.visible(2, 2), [[[0, 0], [0, 1]], [[0, 0], [1, 0]]])
  assert view.keys_needed() is None and view.span == 4
  bounded = KeyView(view.read, Addressing(valid, q_slots, span=4, bounded=True))
  assert int(bounded.keys_needed()) == 4


def test_paged_key_blocks_are_whole_pages():
  at = Addressing(None, None, span=32, block=10)
  assert KeyView(None, at).key_block() == 10
  assert KeyView(None, at, page=4).key_block() == 8   # two whole pages in 10 keys, tiling 32
  assert keys.page_block(32, 16, 8) == 16             # at least a page
  with pytest.raises(ValueError, match="attention span 30 is not a multiple of the page size 4"):
    keys.page_block(30, 4, None)

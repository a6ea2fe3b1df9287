import dataclasses
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxes.train.checkpoint import Checkpointer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _State:
  params: dict
  key: jax.Array
  version: int = dataclasses.field(metadata=dict(static=False))


def _state(seed):
  k = jax.random.key(seed)
  return _State(params={"a": {"kernel": jax.random.normal(k, (3, 4))}, "b": jnp.arange(5, dtype=jnp.int32)},
                key=jax.random.fold_in(k, 7), version=seed)


def _equal(x, y):
  lx, ly = jax.tree.leaves(x), jax.tree.leaves(y)
  assert jax.tree.structure(x) == jax.tree.structure(y)
  for a, b in zip(lx, ly):
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_roundtrip_custom_pytree_with_key_and_scalar(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  ckpt.save(3, _state(3), {"controller": {"version": 3, "queue": [1, 2]}, "pos": 9})
  ckpt.wait()
  step, tree, host = ckpt.restore(lambda host: _state(0))
  ckpt.close()
  assert step == 3 and host == {"controller": {"version": 3, "queue": [1, 2]}, "pos": 9}
  _equal(tree, _state(3))
  assert isinstance(tree.version, int) and tree.version == 3


def test_keep_n_and_step_zero(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  for s in range(1, 5):
    ckpt.save(s, _state(s), {"s": s})
  ckpt.wait()
  assert ckpt.steps() == [3, 4]
  ckpt.close()
  # Step 0 (a run's warm start, loaded by other runs' warmstart.init_from) is never deleted.
  ckpt = Checkpointer(str(tmp_path / "with_zero"), keep=2)
  for s in range(0, 6):
    ckpt.save(s, _state(s), {"s": s})
  ckpt.wait()
  assert ckpt.steps() == [0, 4, 5]
  assert ckpt.restore(lambda host: _state(0), step=0)[2] == {"s": 0}
  ckpt.close()


def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path):
  d = str(tmp_path / "ckpt")
  ckpt = Checkpointer(d, keep=3)
  ckpt.save(1, _state(1), {"s": 1})
  ckpt.save(2, _state(2), {"s": 2})
  ckpt.close()
  # Corrupt every data file of the latest step's arrays.
  files = [f for f in glob.glob(os.path.join(d, "2", "arrays", "**", "*"), recursive=True) if os.path.isfile(f)]
  assert files
  for f in files:
    with open(f, "wb") as fh:
      fh.write(b"\x00garbage")
  ckpt = Checkpointer(d, keep=3)
  with pytest.warns(RuntimeWarning, match="step 2"):
    step, tree, host = ckpt.restore(lambda host: _state(0))
  assert step == 1 and host == {"s": 1}
  _equal(tree, _state(1))
  # The corrupt step is out of the way, so the resumed run can save step 2 again.
  ckpt.save(2, _state(5), {"s": 5})
  ckpt.wait()
  assert ckpt.steps() == [1, 2]
  ckpt.close()


def test_empty_directory_restores_none(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  assert ckpt.restore(lambda host: _state(0)) is None
  ckpt.close()

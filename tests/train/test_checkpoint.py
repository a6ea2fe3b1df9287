"""Checkpointer on real orbax in tmp_path: named items, checksums, corrupt vs mismatch, retention."""
import dataclasses
import glob
import hashlib
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxes.train.checkpoint import (Checkpointer, CheckpointError, CheckpointMismatch, CorruptCheckpoint,
                                    NoRestorableCheckpoint, leaf_names)
import helpers_repo


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _State:
  params: dict
  key: jax.Array
  version: int = dataclasses.field(metadata=dict(static=False))


def _params(seed, width=4):
  k = jax.random.key(seed)
  return {"a": {"kernel": jax.random.normal(k, (64, width))}, "b": jnp.arange(5, dtype=jnp.int32) + seed,
          "h": jax.random.normal(jax.random.fold_in(k, 1), (8,)).astype(jnp.bfloat16)}


def _state(seed, width=4):
  return _State(params=_params(seed, width), key=jax.random.fold_in(jax.random.key(seed), 7), version=seed)


def _items(seed, width=4):
  return {"es": _state(seed, width), "old/3": _params(seed + 100, width)}


def _target(host, width=4):
  return {"es": _state(0, width), **{f"old/{v}": _params(0, width) for v in host["old_versions"]}}


def _equal(x, y):
  assert jax.tree.structure(x) == jax.tree.structure(y)
  for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
    if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(a) == jax.random.key_impl(b)
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tree_hash(root) -> dict:
  """Every file under ``root`` (and its sibling *_superseded folder) -> sha256 of its bytes."""
  out = {}
  for base in (root, root + "_superseded"):
    for f in sorted(glob.glob(os.path.join(base, "**", "*"), recursive=True)):
      if os.path.isfile(f):
        out[f] = hashlib.sha256(open(f, "rb").read()).hexdigest()
  return out


def _data_files(d, step, item="arr_es"):
  """The chunk files orbax (OCDBT) writes for one item of one step, largest first."""
  files = [f for f in glob.glob(os.path.join(d, str(step), item, "**", "d", "*"), recursive=True)
           if os.path.isfile(f)]
  assert files, "orbax wrote no data files where expected"
  return sorted(files, key=os.path.getsize, reverse=True)


def _flip(path, n=64):
  data = bytearray(open(path, "rb").read())
  mid = len(data) // 2
  data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
  open(path, "wb").write(bytes(data))


def _save_steps(d, steps, keep=5):
  ckpt = Checkpointer(d, keep=keep)
  for s in steps:
    ckpt.save(s, _items(s), {"s": s, "old_versions": [3]})
  ckpt.close()


def test_roundtrip_named_items_with_keys_scalars_and_numpy(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  host = {"controller": {"version": 3, "queue": [1, 2]}, "pos": 9, "old_versions": [3]}
  items = {**_items(3),
           "host_arrays": {"n": np.arange(6, dtype=np.int64).reshape(2, 3), "lr": 0.5, "on": True}}
  ckpt.save(3, items, host)
  ckpt.wait()
  target = lambda h: {**_target(h), "host_arrays": {"n": np.zeros((2, 3), np.int64), "lr": 0.0, "on": False}}
  step, trees, restored_host = ckpt.restore(target)
  assert step == 3 and restored_host == host and ckpt.restore_host(3) == host
  assert set(trees) == {"es", "old/3", "host_arrays"}
  _equal(trees, items)
  assert isinstance(trees["es"].version, int) and trees["es"].version == 3
  assert trees["host_arrays"]["n"].dtype == np.int64 and type(trees["host_arrays"]["lr"]) is float
  ckpt.close()


def test_a_version_saved_as_a_0d_array_restores_into_an_int_and_back(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, {"es": dataclasses.replace(_state(1), version=jnp.asarray(1, jnp.int32))}, {})
  ckpt.save(2, {"es": _state(2)}, {})
  ckpt.wait()
  as_int = ckpt.restore_item(1, "es", _state(0))
  assert type(as_int.version) is int and as_int.version == 1
  as_array = ckpt.restore_item(2, "es", dataclasses.replace(_state(0), version=jnp.asarray(0, jnp.int32)))
  assert as_array.version.dtype == jnp.int32 and int(as_array.version) == 2
  wrong_kind = r"'version' is stored as a Python int, this run expects float32\["
  with pytest.raises(CheckpointMismatch, match=wrong_kind):
    ckpt.restore_item(2, "es", dataclasses.replace(_state(0), version=jnp.asarray(0.0)))
  ckpt.close()


def test_leaves_are_named_by_key_path():
  assert leaf_names(_state(0)) == ["params/a/kernel", "params/b", "params/h", "key", "version"]
  assert leaf_names({"a/b": 1, "a": {"b": 2}}) == ["a/b", "a%2Fb"]   # "/" in a key never collides


def test_keep_n_and_step_zero(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  for s in range(1, 5):
    ckpt.save(s, _items(s), {"s": s, "old_versions": [3]})
  ckpt.wait()
  assert ckpt.steps() == [3, 4]
  ckpt.close()
  # Step 0 (a run's warm start, loaded by other runs' warmstart.init_from) is never deleted.
  ckpt = Checkpointer(str(tmp_path / "with_zero"), keep=2)
  for s in range(0, 6):
    ckpt.save(s, _items(s), {"s": s, "old_versions": [3]})
  ckpt.wait()
  assert ckpt.steps() == [0, 4, 5]
  step, trees, host = ckpt.restore(_target, step=0)
  assert host["s"] == 0
  _equal(trees, _items(0))
  ckpt.close()


def test_flipped_bytes_are_detected_and_fall_back_leaving_the_step_untouched(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [1, 2])
  _flip(_data_files(d, 2)[0])   # 64 bytes inside the largest array chunk of step 2
  before = _tree_hash(d)
  ckpt = Checkpointer(d, keep=5)
  corrupt = r"step 2 .* corrupt \((checksum mismatch in item 'es'|arrays unreadable)"
  with pytest.warns(RuntimeWarning, match=corrupt):
    step, trees, host = ckpt.restore(_target)
  assert step == 1 and host["s"] == 1
  _equal(trees, _items(1))
  assert _tree_hash(d) == before and ckpt.steps() == [1, 2]   # nothing moved or deleted
  with pytest.raises(CorruptCheckpoint, match="step 2 .* corrupt"):
    ckpt.restore(_target, step=2)
  ckpt.close()


def test_a_truncated_chunk_warns_with_the_read_error_not_an_object_repr(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [1, 2])
  open(_data_files(d, 2)[0], "wb").close()   # the largest chunk file of step 2, cut to 0 bytes
  ckpt = Checkpointer(d, keep=5)
  with pytest.warns(RuntimeWarning, match=r"step 2 .* corrupt \(arrays unreadable in item 'es' "
                                          r"\(ValueError: [A-Z_]+: ") as said:
    assert ckpt.restore(_target)[0] == 1
  message = str(said[0].message)
  assert "<bound method" not in message and " object at 0x" not in message, message
  ckpt.close()


def test_flipped_bytes_in_a_non_es_item_are_detected(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [1, 2])
  _flip(_data_files(d, 2, "arr_old_3")[0])
  ckpt = Checkpointer(d, keep=5)
  with pytest.warns(RuntimeWarning, match="step 2"):
    assert ckpt.restore(_target)[0] == 1
  # Restoring only the intact item of step 2 works: an item that is not read is not checked.
  assert ckpt.restore(_target, items=("es",))[0] == 2
  ckpt.close()


def test_missing_item_and_bad_meta_are_corrupt(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [1, 2, 3])
  os.rename(os.path.join(d, "3", "arr_old_3"), str(tmp_path / "elsewhere"))   # a torn step
  meta = [f for f in glob.glob(os.path.join(d, "2", "meta", "*")) if os.path.basename(f) == "metadata"][0]
  text = open(meta).read()
  open(meta, "w").write(text.replace('"s": 2', '"s": 7'))   # valid JSON, wrong content
  ckpt = Checkpointer(d, keep=5)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step, _, host = ckpt.restore(_target)
  assert step == 1 and host["s"] == 1
  messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert any("step 3" in m and "'old/3' is missing" in m for m in messages)
  assert any("step 2" in m and "meta checksum mismatch" in m for m in messages)
  ckpt.close()


def test_config_change_is_a_mismatch_and_every_checkpoint_stays_byte_identical(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [0, 1, 2])
  before = _tree_hash(d)
  ckpt = Checkpointer(d, keep=5)
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # no fallback warning: a mismatch is not corruption
    with pytest.raises(CheckpointMismatch) as e:
      ckpt.restore(lambda h: _target(h, width=6))
  err = e.value
  assert (err.step, err.item, err.leaf, err.stored, err.expected) == (2, "es", "params/a/kernel",
                                                                      "float32[64, 4]", "float32[64, 6]")
  assert "params/a/kernel" in str(err) and "float32[64, 4]" in str(err) and "\n" not in str(err)
  # A renamed leaf and a changed dtype name the leaf too.
  renamed = lambda h: {**_target(h),
                       "es": dataclasses.replace(_state(0), params={**_params(0), "c": jnp.zeros(5)})}
  with pytest.raises(CheckpointMismatch, match=r"leaf 'params/c' is stored as absent"):
    ckpt.restore(renamed)
  retyped = lambda h: {**_target(h), "old/3": {**_params(0), "h": jnp.zeros(8, jnp.float32)}}
  retyped_message = r"'old/3' leaf 'h' is stored as bfloat16\[8\], this run expects float32\[8\]"
  with pytest.raises(CheckpointMismatch, match=retyped_message):
    ckpt.restore(retyped)
  with pytest.raises(CheckpointMismatch, match="'old/5'"):
    ckpt.restore(lambda h: {**_target(h), "old/5": _params(0)})
  ckpt.close()
  assert _tree_hash(d) == before


def test_every_step_corrupt_raises_no_restorable_checkpoint(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [0, 1, 2])
  for s in (0, 1, 2):
    _flip(_data_files(d, s)[0])
  before = _tree_hash(d)
  ckpt = Checkpointer(d, keep=5)
  with pytest.warns(RuntimeWarning), pytest.raises(NoRestorableCheckpoint) as e:
    ckpt.restore(_target)
  assert [s for s, _ in e.value.failures] == [2, 1, 0]
  assert "--restart" in str(e.value) and "new workdir" in str(e.value)
  assert _tree_hash(d) == before
  ckpt.close()


def test_partial_restore_against_abstract_sharded_targets(tmp_path):
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
  shard = NamedSharding(mesh, P("fsdp"))
  d = str(tmp_path / "ckpt")
  _save_steps(d, [4])

  def abstract(tree):
    def one(x):
      split = getattr(x, "ndim", 0) and x.shape[0] % jax.device_count() == 0
      sharding = shard if split else NamedSharding(mesh, P())
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) if isinstance(x, jax.Array) else x
    return jax.tree.map(one, tree)

  ckpt = Checkpointer(d, keep=5)
  # Only the ES state, against ShapeDtypeStructs (the old versions are not read).
  step, trees, _ = ckpt.restore(lambda h: {"es": abstract(_state(0)), "old/3": _params(0)}, items=("es",))
  assert step == 4 and set(trees) == {"es"}
  _equal(trees["es"], _state(4))
  assert trees["es"].params["a"]["kernel"].sharding == shard
  assert trees["es"].key.sharding == NamedSharding(mesh, P())
  # Only the params of the ES state (load_policy): other leaves of the item are not needed.
  params = ckpt.restore_item(4, "es", {"params": abstract(_params(0))}, partial=True)["params"]
  _equal(params, _params(4))
  with pytest.raises(CheckpointMismatch, match="leaf 'key'"):   # not partial: every stored leaf is expected
    ckpt.restore_item(4, "es", {"params": abstract(_params(0))})
  ckpt.close()


def test_checksums_do_not_depend_on_sharding(tmp_path):
  mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "fsdp"))
  x = jax.random.normal(jax.random.key(0), (16, 32))
  sharded = jax.device_put(x, NamedSharding(mesh, P("data", "fsdp")))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, {"w": {"x": sharded}}, {})
  ckpt.wait()
  for sharding in (NamedSharding(mesh, P(None, "data")), jax.sharding.SingleDeviceSharding(jax.devices()[3])):
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
    restored = ckpt.restore_item(1, "w", target)["x"]
    assert restored.sharding == sharding
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(x))
  ckpt.close()


def test_saving_after_a_fallback_supersedes_newer_steps_without_deleting_them(tmp_path):
  d = str(tmp_path / "ckpt")
  _save_steps(d, [1, 2, 3])
  _flip(_data_files(d, 3)[0])
  corrupt = {os.path.relpath(f, os.path.join(d, "3")): h for f, h in _tree_hash(d).items()
             if f.startswith(os.path.join(d, "3") + os.sep)}
  ckpt = Checkpointer(d, keep=5)
  with pytest.warns(RuntimeWarning, match="step 3"):
    assert ckpt.restore(_target)[0] == 2
  # The resumed run reaches version 3 again: the corrupt step 3 moves aside, byte for byte.
  with pytest.warns(RuntimeWarning, match=r"supersedes steps \[3\]"):
    ckpt.save(3, _items(30), {"s": 30, "old_versions": [3]})
  ckpt.wait()
  assert ckpt.steps() == [1, 2, 3] and ckpt.restore(_target)[2]["s"] == 30
  aside = os.path.join(d + "_superseded", "3")
  assert {os.path.relpath(f, aside): h for f, h in _tree_hash(aside).items()} == corrupt
  ckpt.close()


def test_bad_host_dict_and_unknown_step_are_one_line_errors(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  with pytest.raises(CheckpointError, match="host dict is not JSON-serialisable"):
    ckpt.save(1, _items(1), {"x": object()})
  assert ckpt.steps() == []
  ckpt.save(1, _items(1), {"old_versions": [3]})
  ckpt.wait()
  with pytest.raises(CheckpointError, match=r"no checkpoint step 5 .*steps: \[1\]"):
    ckpt.restore(_target, step=5)
  ckpt.close()


def test_earlier_positional_format_is_named_not_treated_as_corrupt(tmp_path):
  d = str(tmp_path / "ckpt")
  old = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(create=True),
                              item_names=("arrays", "host"))
  old.save(1, args=ocp.args.Composite(arrays=ocp.args.StandardSave({"00000_a": np.zeros(3)}),
                                      host=ocp.args.JsonSave({"s": 1})))
  old.wait_until_finished()
  old.close()
  ckpt = Checkpointer(d)
  with pytest.raises(CheckpointError, match="earlier jaxes format.*--restart"):
    ckpt.restore(_target)
  ckpt.close()


def test_empty_directory_restores_none(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  assert ckpt.restore(_target) is None
  ckpt.close()


_MULTI_PROCESS_WORKER = r'''
import json, pathlib, sys, warnings
from jaxes import distributed
distributed.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxes.train.checkpoint import Checkpointer

directory, phase, out = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
mesh = distributed.global_mesh(jax.device_count(), 1, 1)
rows = NamedSharding(mesh, P("data"))

def tree(seed):   # a global array split over both processes' devices, a replicated key, a scalar
  full = np.random.default_rng(seed).standard_normal((1024, 64)).astype(np.float32)
  x = jax.make_array_from_callback(full.shape, rows, lambda index: full[index])
  key = jax.jit(lambda: jax.random.key(seed), out_shardings=NamedSharding(mesh, P()))()
  return {"w": x, "key": key, "version": seed}, full

def target(host):
  return {"es": {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32, sharding=rows),
                 "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P())),
                 "version": 0}}

ckpt = Checkpointer(directory, keep=5)
if phase == "save":
  for s in (1, 2, 3):
    ckpt.save(s, {"es": tree(s)[0]}, {"s": s})
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  step, trees, host = ckpt.restore(target)
  if phase == "fallback":   # the resumed run saves step 2 again: the corrupt one is set aside
    ckpt.save(2, {"es": tree(20)[0]}, {"s": 20})
    ckpt.wait()
full = tree(step)[1]
local_ok = all(np.array_equal(np.asarray(shard.data), full[shard.index])
               for shard in trees["es"]["w"].addressable_shards)
result = {"step": step, "host": host, "local_ok": local_ok, "version": trees["es"]["version"],
          "key": np.asarray(jax.random.key_data(trees["es"]["key"]).addressable_data(0)).tolist(),
          "steps": ckpt.steps(), "warnings": [str(w.message) for w in caught]}
ckpt.close()
(out / f"{phase}-{jax.process_index()}.json").write_text(json.dumps(result))
'''


@pytest.mark.end_to_end
def test_two_processes_save_their_shards_and_detect_corruption(tmp_path):
  """Real multi-process JAX (2 processes x 4 CPU devices, gloo): every process writes its shards,
  checksums of the global arrays agree across processes, a flipped byte falls back on both."""
  root = str(helpers_repo.REPO)
  worker = tmp_path / "worker.py"
  worker.write_text(_MULTI_PROCESS_WORKER)
  d = str(tmp_path / "ckpt")
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "JAXES_", "XLA_FLAGS"))}
  env["JAX_PLATFORMS"] = "cpu"

  def run(phase):
    proc = subprocess.run(["bash", os.path.join(root, "launch", "local.sh"), "--devices", "4", "2", "--",
                           sys.executable, str(worker), d, phase, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{phase}-{i}.json").read_text()) for i in range(2)]

  for r in run("save"):
    assert r["step"] == 3 and r["host"] == {"s": 3} and r["local_ok"] and r["version"] == 3
    assert r["warnings"] == []
  process_files = {os.path.basename(os.path.dirname(os.path.dirname(f)))
                   for f in glob.glob(os.path.join(d, "3", "arr_es", "ocdbt.process_*", "d", "*"))}
  assert process_files == {"ocdbt.process_0", "ocdbt.process_1"}   # each process wrote its shards

  def shard_file(step):   # the largest chunk file process 1 wrote: only process 1 reads it back
    return max(glob.glob(os.path.join(d, str(step), "arr_es", "ocdbt.process_1", "d", "*")),
               key=os.path.getsize)

  _flip(shard_file(3), 16)
  truncated = shard_file(2)
  with open(truncated, "r+b") as f:   # a read error on process 1 alone: both must still agree
    f.truncate(os.path.getsize(truncated) // 2)
  before = _tree_hash(d)
  for r in run("fallback"):
    assert r["step"] == 1 and r["local_ok"] and r["version"] == 1 and r["steps"] == [1, 2]
    assert any("step 3" in w and "corrupt" in w for w in r["warnings"])
    assert any("step 2" in w and "on process 1: arrays unreadable" in w for w in r["warnings"])
  after = _tree_hash(d)
  for s in (2, 3):   # moved aside once, by process 0, byte for byte
    prefix = os.path.join(d, str(s)) + os.sep
    moved = {f.replace(prefix, os.path.join(d + "_superseded", str(s)) + os.sep): h
             for f, h in before.items() if f.startswith(prefix)}
    assert moved and all(after[f] == h for f, h in moved.items())

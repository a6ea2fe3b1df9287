"""Checkpoints: named pytrees per step, a checksum per array, restore that tells corrupt from mismatched.

One step of an orbax ``CheckpointManager`` holds named items (``{"es": ESState, "old/3": params}``),
each an orbax pytree item whose leaves are stored under their key-path names (``params/embed/
embedding/value``), and one JSON ``meta`` item: the host dict plus, per item, every leaf's name,
shape, dtype and a content checksum, the whole guarded by its own crc32. Saves are asynchronous and
orbax commits a step atomically (temporary directory + rename).

Restore reads the newest step's ``meta`` and compares the target's leaves with it by name before any
array is read:

- *mismatch* (a leaf is missing, extra, or has another shape or dtype — a config change): raise
  ``CheckpointMismatch`` naming the item, the leaf, the stored and the expected shape; no other step
  is looked at and nothing is moved.
- *corrupt* (unreadable files, a missing item, a checksum that does not match the bytes read back):
  warn and try the previous step. Nothing is moved or deleted by a restore.
- every step corrupt: ``NoRestorableCheckpoint``, which says how to start fresh.

Saving step ``s`` when steps ``>= s`` exist (the run resumed from an older step, or restarted) moves
those steps to ``<directory>_superseded/`` — never deleted. Retention keeps the newest ``keep`` steps
and step 0 for good (other runs load it with ``warmstart.init_from``).

Array checksums are computed on the devices by one jitted reduction per leaf (two 32-bit sums of the
array's words, see ``_device_hash``), so a sharded 7B state is hashed where it lives, across hosts,
without a host copy; host leaves (numpy arrays, Python scalars) use ``zlib.crc32`` of their bytes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zlib
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy

from jaxes import distributed

FORMAT = 1
_META = "meta"   # the JSON item; array items are stored as "arr_<name>" so they never collide with it


class CheckpointError(RuntimeError):
  """A checkpoint cannot be saved or restored."""


class CheckpointMismatch(CheckpointError):
  """The stored structure, shape or dtype differs from the target (typically a changed config)."""

  def __init__(self, directory: str, step: int, item: str, leaf: str, stored: str, expected: str):
    self.step, self.item, self.leaf, self.stored, self.expected = step, item, leaf, stored, expected
    super().__init__(f"checkpoint step {step} in {directory} does not match this run: item {item!r} "
                     f"leaf {leaf!r} is stored as {stored}, this run expects {expected} "
                     f"(nothing was moved or deleted)")


class CorruptCheckpoint(CheckpointError):
  """One step cannot be read back intact (unreadable file, missing item, checksum mismatch)."""

  def __init__(self, directory: str, step: int, reason: str):
    self.step, self.reason = step, reason
    super().__init__(f"checkpoint step {step} in {directory} is corrupt: {reason}")


class NoRestorableCheckpoint(CheckpointError):
  """Steps exist but every one is corrupt."""

  def __init__(self, directory: str, failures: list[tuple[int, str]]):
    self.failures = failures
    tried = "; ".join(f"step {s}: {r}" for s, r in failures)
    super().__init__(f"no restorable checkpoint in {directory} (tried {tried}); nothing was moved or "
                     f"deleted. To start fresh, rerun with --restart or use a new workdir")


# -- leaves by name ---------------------------------------------------------------------------------
def _path_part(k) -> str:
  if isinstance(k, jax.tree_util.DictKey):
    s = str(k.key)
  elif isinstance(k, jax.tree_util.GetAttrKey):
    s = k.name
  elif isinstance(k, jax.tree_util.SequenceKey):
    s = str(k.idx)
  elif isinstance(k, jax.tree_util.FlattenedIndexKey):
    s = str(k.key)
  else:
    s = str(k)
  return s.replace("%", "%25").replace("/", "%2F")   # names stay unique and readable


def leaf_names(tree) -> list[str]:
  """Each leaf's key path as ``a/b/0/c`` (the name it is stored and matched under)."""
  return ["/".join(_path_part(k) for k in path) or "." for path, _ in
          jax.tree_util.tree_flatten_with_path(tree)[0]]


def _is_key_dtype(dtype) -> bool:
  return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _spec(x) -> dict:
  """What a leaf is, as stored in ``meta``: kind, dtype and shape (of the key, for typed keys)."""
  if isinstance(x, (bool, int, float)):
    return {"kind": "scalar", "dtype": type(x).__name__, "shape": []}
  if isinstance(x, (np.ndarray, np.generic)):
    return {"kind": "numpy", "dtype": str(x.dtype), "shape": list(x.shape)}
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    kind = "key" if _is_key_dtype(x.dtype) else "jax"
    return {"kind": kind, "dtype": str(x.dtype), "shape": list(x.shape)}
  raise CheckpointError(f"cannot checkpoint a leaf of type {type(x).__name__}")


def _describe(spec: dict | None) -> str:
  if spec is None:
    return "absent"
  if spec["kind"] == "scalar":
    return f"a Python {spec['dtype']}"
  return f"{spec['dtype']}[{', '.join(map(str, spec['shape']))}]"


def _dtype_class(spec: dict) -> str:
  dtype = {"int": "int64", "float": "float64", "bool": "bool"}.get(spec["dtype"], spec["dtype"])
  return "key" if spec["kind"] == "key" else np.dtype(dtype).kind.replace("u", "i")


def _compatible(stored: dict, expected: dict) -> bool:
  if stored["shape"] != expected["shape"]:
    return False
  if "scalar" in (stored["kind"], expected["kind"]):   # an int version may come back as a 0-d array
    return _dtype_class(stored) == _dtype_class(expected)
  return stored["dtype"] == expected["dtype"]


# -- checksums ------------------------------------------------------------------------------------
def _words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words (one per element; two for 8-byte dtypes)."""
  size = np.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)   # trailing axis of 2
  return jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[size]).astype(jnp.uint32)


@jax.jit
def _device_hash(x: jax.Array) -> jax.Array:
  """Two 32-bit position-weighted sums of the words: any change to one word changes the first
  (odd weights); the second mixes bits (murmur3's constants) so that multi-word changes cancel in
  both with probability ~2^-64. Sums are exact mod 2^32, so the value does not depend on sharding."""
  u = _words(x)
  idx = jnp.zeros(u.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(u.ndim)):   # flat index without a reshape (no resharding)
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= u.shape[axis]
  a = jnp.sum(u * (2 * idx + 1), dtype=jnp.uint32)
  m = u * jnp.uint32(0xCC9E2D51)
  m = ((m << 15) | (m >> 17)) * jnp.uint32(0x1B873593) ^ (idx * jnp.uint32(0x9E3779B9))
  b = jnp.sum(m ^ (m >> 16), dtype=jnp.uint32)
  return jnp.stack([a, b])


def _checksums(values: list) -> list[str]:
  """``d:`` device hash for jax arrays, ``c:`` crc32 for host arrays. One hash in flight at a
  time: a multi-process run saving the GRPO learner state (~70 hashes, each a cross-device sum)
  hung once with them all dispatched at once, both processes blocked in dispatch."""
  out = []
  for v in values:
    if not isinstance(v, jax.Array):
      out.append(f"c:{zlib.crc32(np.ascontiguousarray(v).tobytes()):08x}")
    else:   # replicated result: any local copy (works on every process of a multi-host run)
      a, b = np.asarray(_device_hash(v).addressable_data(0)).tolist()
      out.append(f"d:{a:08x}{b:08x}")
  return out


def _one_line(e: Exception) -> str:
  """The root cause of ``e`` in one line. Orbax wraps tensorstore's read error (which says what is
  wrong: a short file, a bad checksum) in an ``Exception`` whose message formats the uncalled
  ``TensorStore.spec`` method (a bound-method repr); the error it was raised from is the reason."""
  while e.__cause__ is not None:
    e = e.__cause__
  return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _json_crc(body: dict) -> int:
  return zlib.crc32(json.dumps(body, sort_keys=True).encode())


# -- encoding items -------------------------------------------------------------------------------
def _storage_keys(names: list[str]) -> list[str]:
  keys, seen = [], set()
  for i, n in enumerate(names):
    k = re.sub(r"[^A-Za-z0-9_-]+", "_", n).strip("_") or "leaf"
    k = k if k not in seen else f"{k}__{i}"
    seen.add(k)
    keys.append(k)
  return keys


def _stored_value(x):
  if isinstance(x, jax.Array):
    return jax.random.key_data(x) if _is_key_dtype(x.dtype) else x
  return np.asarray(x)


def _encode(tree) -> tuple[dict, dict]:
  """(leaf records for ``meta``, {storage key: value} for orbax)."""
  names, leaves = leaf_names(tree), jax.tree.leaves(tree)
  values = [_stored_value(x) for x in leaves]
  records, data = {}, {}
  for name, key, x, v, s in zip(names, _storage_keys(names), leaves, values, _checksums(values)):
    records[name] = {**_spec(x), "key": key, "sum": s}
    if records[name]["kind"] == "key":
      records[name]["impl"] = str(jax.random.key_impl(x))
    data[key] = v
  return records, data


def _data_sharding(ref, data_ndim: int):
  """Where a leaf's stored data goes: the target's sharding (extended for typed keys' data axis)."""
  sharding = getattr(ref, "sharding", None)
  if sharding is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if isinstance(ref, (jax.Array, jax.ShapeDtypeStruct)) and _is_key_dtype(ref.dtype):
    if isinstance(sharding, jax.sharding.NamedSharding):
      spec = tuple(sharding.spec) + (None,) * (data_ndim - len(sharding.spec))
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
      raise CheckpointError(f"restoring a typed key with a {type(sharding).__name__} is not supported")
  return sharding


def _restore_args(record: dict, ref):
  """Read each leaf back as it was stored (so its checksum can be checked), placed like the target."""
  shape = tuple(record["shape"])
  if record["kind"] == "key":
    shape = shape + tuple(jax.eval_shape(lambda: jax.random.key_data(
        jax.random.key(0, impl=record["impl"]))).shape)
    return ocp.ArrayRestoreArgs(sharding=_data_sharding(ref, len(shape)), global_shape=shape,
                                dtype=jnp.uint32)
  if record["kind"] == "jax":
    return ocp.ArrayRestoreArgs(sharding=_data_sharding(ref, len(shape)), global_shape=shape,
                                dtype=np.dtype(record["dtype"]))
  return ocp.RestoreArgs(restore_type=np.ndarray)


def _decode(record: dict, value, ref):
  """A stored value in the target leaf's form (typed key, Python scalar, numpy or jax array)."""
  if record["kind"] == "key":
    return jax.random.wrap_key_data(value, impl=record["impl"])
  if isinstance(ref, (bool, int, float)):
    return type(ref)(np.asarray(value).item())
  if isinstance(ref, (np.ndarray, np.generic)):
    return np.asarray(value, dtype=ref.dtype)
  if isinstance(value, jax.Array) and value.dtype == ref.dtype:
    return value
  return jax.device_put(jnp.asarray(np.asarray(value), dtype=ref.dtype), _data_sharding(ref, value.ndim))


class Checkpointer:
  """``save(step, items, host)``; ``restore(make_target)`` -> ``(step, items, host)`` or None."""

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.superseded_directory = self.directory + "_superseded"
    # The newest `keep` steps, and step 0 for good: it is the run's starting point (the warm
    # start), which other runs load with `warmstart.init_from`.
    policy = preservation_policy.AnyPreservationPolicy(
        [preservation_policy.LatestN(keep), preservation_policy.CustomSteps([0])])
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(preservation_policy=policy,
                                             enable_async_checkpointing=async_save,
                                             create=True, cleanup_tmp_directories=True))

  # -- saving -------------------------------------------------------------------------------------
  def save(self, step: int, items: dict[str, Any], host: dict) -> None:
    """Save named pytrees and a JSON-able host dict as ``step`` (asynchronously)."""
    self._supersede(step)
    meta_items, args = {}, {}
    dirs = dict(zip(items, _storage_keys(list(items))))
    for name, tree in items.items():
      records, data = _encode(tree)
      meta_items[name] = {"dir": f"arr_{dirs[name]}" if data else None, "leaves": records}
      if data:
        args[f"arr_{dirs[name]}"] = ocp.args.PyTreeSave(data)
    body = {"format": FORMAT, "host": host, "items": meta_items}
    try:
      crc = _json_crc(body)
    except (TypeError, ValueError) as e:
      raise CheckpointError(f"checkpoint step {step}: the host dict is not JSON-serialisable "
                            f"({e})") from None
    args[_META] = ocp.args.JsonSave({"body": body, "crc32": crc})
    if not self._manager.save(step, args=ocp.args.Composite(**args)):
      raise CheckpointError(f"orbax declined to save step {step} in {self.directory}")

  def _supersede(self, step: int) -> None:
    """Steps >= ``step`` belong to a timeline this run has left (it resumed from an older step or
    restarted): move them aside, never delete them."""
    self.set_aside(step, f"saving checkpoint step {step} supersedes")

  def set_aside(self, step: int, why: str = "set aside") -> list[str]:
    """Moves every step >= ``step`` to ``<directory>_superseded/`` (a step already there keeps its
    name: the newcomer is ``<step>.1``, ...) with a warning that starts with ``why``; returns
    where they went."""
    # The manager's cached listing, so every process of a multi-host run sees the same steps.
    later = [s for s in self.steps() if s >= step]
    if not later:
      return []
    self._manager.wait_until_finished()
    moved = []
    if jax.process_index() == 0:
      for s in later:
        dest = os.path.join(self.superseded_directory, str(s))
        n = 1
        while os.path.exists(dest):
          dest, n = os.path.join(self.superseded_directory, f"{s}.{n}"), n + 1
        os.makedirs(self.superseded_directory, exist_ok=True)
        shutil.move(os.path.join(self.directory, str(s)), dest)
        moved.append(dest)
    distributed.barrier(f"jaxes-checkpoint-supersede-{step}")   # the others wait for the move
    self._manager.reload()
    warnings.warn(f"{why} steps {later} of {self.directory}; moved them to "
                  f"{moved or self.superseded_directory}", RuntimeWarning, stacklevel=3)
    return moved

  # -- restoring ----------------------------------------------------------------------------------
  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, make_target: Callable[[dict], dict[str, Any]], step: int | None = None,
              items: Iterable[str] | None = None, partial: bool = False):
    """``(step, {item: tree}, host)`` from the newest restorable step (or exactly ``step``); None
    when there are no steps. ``make_target(host)`` gives ``{item: target pytree}`` (concrete arrays
    or ``jax.ShapeDtypeStruct`` with shardings); only those items (or ``items`` of them) are read.
    ``partial``: a target may hold a subset of an item's stored leaves (e.g. ``{"params": ...}`` of
    an ES state); only those are read."""
    self._manager.wait_until_finished()   # a step still being written is not yet a step
    steps = self.steps()
    if not steps:
      return None
    if step is not None:
      if step not in steps:
        raise CheckpointError(f"no checkpoint step {step} in {self.directory} (steps: {steps})")
      return step, *self._restore_step(step, make_target, items, partial)
    failures = []
    for s in reversed(steps):
      try:
        return s, *self._restore_step(s, make_target, items, partial)
      except CorruptCheckpoint as e:
        warnings.warn(f"checkpoint step {s} in {self.directory} is corrupt ({e.reason}); trying the "
                      f"previous step (nothing moved or deleted)", RuntimeWarning, stacklevel=2)
        failures.append((s, e.reason))
    raise NoRestorableCheckpoint(self.directory, failures)

  def restore_item(self, step: int, name: str, target, partial: bool = False):
    """One item of exactly ``step``, e.g. the params of a run's ES state for ``load_policy``:
    ``restore_item(step, "es", {"params": abstract_params}, partial=True)["params"]``."""
    return self.restore(lambda host: {name: target}, step=step, partial=partial)[1][name]

  def restore_host(self, step: int) -> dict:
    """The host dict of ``step`` (no arrays read)."""
    self._manager.wait_until_finished()
    return self._meta(step)["host"]

  def _meta(self, step: int) -> dict:
    step_dir = os.path.join(self.directory, str(step))
    if not os.path.isdir(os.path.join(step_dir, _META)):
      if os.path.isdir(os.path.join(step_dir, "arrays")):
        raise CheckpointError(
            f"checkpoint step {step} in {self.directory} was written by an earlier jaxes format "
            f"(leaves stored by position) that this version cannot read; rerun with --restart (old "
            f"steps are moved to {self.superseded_directory}, never deleted) or use a new workdir")
      raise CorruptCheckpoint(self.directory, step, "its meta item is missing")
    body, reason = None, None
    try:
      stored = self._read(step, _META, ocp.JsonCheckpointHandler(), ocp.args.JsonRestore())
      body = stored["body"]
      if stored["crc32"] != _json_crc(body) or body["format"] != FORMAT:
        reason = "meta checksum mismatch"
    except Exception as e:   # unreadable or not our layout: the step cannot be trusted
      reason = f"meta unreadable ({_one_line(e)})"
    self._agree(step, reason)
    return body

  def _read(self, step: int, item: str, handler, args):
    """One item through its orbax handler. Not through ``CheckpointManager.restore``: its closing
    barrier would be skipped by a process whose read failed, and the others would wait in it."""
    try:
      return handler.restore(epath.Path(self.directory) / str(step) / item, args=args)
    finally:
      handler.close()

  def _agree(self, step: int, reason: str | None) -> None:
    """Raise CorruptCheckpoint if this process, or (multi-process) any process, failed to read the
    step: each process reads its own shards, and all of them must fall back together."""
    if jax.process_count() > 1:
      reasons = distributed.allgather_host(reason)
      reason = next((f"on process {i}: {r}" for i, r in enumerate(reasons) if r), None)
    if reason:
      raise CorruptCheckpoint(self.directory, step, reason)

  def _plan(self, step: int, name: str, stored: dict | None, target, partial: bool):
    """[(leaf name, stored record, target leaf)] or CheckpointMismatch at the first difference."""
    names, refs = leaf_names(target), jax.tree.leaves(target)
    if stored is None:
      leaf = names[0] if names else "."
      raise CheckpointMismatch(self.directory, step, name, leaf, "absent (no such item)",
                               _describe(_spec(refs[0])) if refs else "an empty item")
    records = stored["leaves"]
    for n, ref in zip(names, refs):
      expected = _spec(ref)
      if n not in records or not _compatible(records[n], expected):
        raise CheckpointMismatch(self.directory, step, name, n, _describe(records.get(n)),
                                 _describe(expected))
    extra = [] if partial else [n for n in records if n not in set(names)]
    if extra:
      raise CheckpointMismatch(self.directory, step, name, extra[0], _describe(records[extra[0]]),
                               "absent")
    return [(n, records[n], ref) for n, ref in zip(names, refs)]

  def _restore_step(self, step, make_target, items, partial):
    body = self._meta(step)
    targets = make_target(body["host"])
    if items is not None:
      missing = [k for k in items if k not in targets]
      if missing:
        raise CheckpointError(f"restore items {missing}: make_target gave no target for them")
      targets = {k: targets[k] for k in items}
    plans = {k: self._plan(step, k, body["items"].get(k), t, partial) for k, t in targets.items()}
    dirs = {k: body["items"][k]["dir"] for k in targets}
    for k, d in dirs.items():
      if d is not None and not os.path.isdir(os.path.join(self.directory, str(step), d)):
        raise CorruptCheckpoint(self.directory, step, f"item {k!r} is missing (directory {d})")
    read, reason = {}, None
    for k, plan in plans.items():
      args = ocp.args.PyTreeRestore(item={r["key"]: 0 for _, r, _ in plan}, partial_restore=True,
                                    restore_args={r["key"]: _restore_args(r, ref) for _, r, ref in plan})
      try:
        read[k] = self._read(step, dirs[k], ocp.PyTreeCheckpointHandler(), args) if plan else {}
      except Exception as e:   # tensorstore/orbax failed to read the bytes back
        reason = f"arrays unreadable in item {k!r} ({_one_line(e)})"
        break
    self._agree(step, reason)
    trees = {}
    for k, plan in plans.items():
      values = [read[k][r["key"]] for _, r, _ in plan]
      for (n, r, _), s in zip(plan, _checksums(values)):
        if s != r["sum"]:
          raise CorruptCheckpoint(self.directory, step, f"checksum mismatch in item {k!r} leaf {n!r}")
      treedef = jax.tree.structure(targets[k])
      leaves = [_decode(r, v, ref) for (_, r, ref), v in zip(plan, values)]
      trees[k] = jax.tree.unflatten(treedef, leaves)
    return trees, body["host"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

"""Checkpoints: one orbax ``CheckpointManager`` step = an array pytree + a JSON-able host dict.

The array pytree (ES state with params and optimizer state, live old-version params, RNG keys) is
stored leaf by leaf under its key path, so any pytree — custom nodes, typed PRNG keys, Python
scalars — round-trips against a target of the same structure. The host dict (controller state,
sampler position, counters) is stored as JSON. Saves are asynchronous; orbax commits a step
atomically (temporary directory + rename), so a process killed mid-save leaves the previous step
intact. A latest step that fails to restore is moved aside with a warning and the previous one is
used. The newest ``keep`` steps are kept, and step 0 always.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy


def _leaf_names(tree) -> list[str]:
  paths, _ = zip(*jax.tree_util.tree_flatten_with_path(tree)[0]) if jax.tree.leaves(tree) else ((), ())
  names = [re.sub(r"[^A-Za-z0-9_.-]+", "_", jax.tree_util.keystr(p)).strip("_") or "leaf" for p in paths]
  # Disambiguate by position so two paths that sanitise alike never collide.
  return [f"{i:05d}_{n}" for i, n in enumerate(names)]


def _is_key(x) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_arrays(tree) -> dict[str, Any]:
  leaves = jax.tree.leaves(tree)
  out = {}
  for name, x in zip(_leaf_names(tree), leaves):
    out[name] = jax.random.key_data(x) if _is_key(x) else np.asarray(x) if not isinstance(x, jax.Array) else x
  return out


def _from_arrays(arrays: dict[str, Any], target):
  leaves, treedef = jax.tree.flatten(target)
  restored = []
  for name, ref in zip(_leaf_names(target), leaves):
    x = arrays[name]
    if _is_key(ref):
      restored.append(jax.random.wrap_key_data(jnp.asarray(x), impl=jax.random.key_impl(ref)))
    elif isinstance(ref, (bool, int, float)):
      restored.append(type(ref)(np.asarray(x).item()))
    elif isinstance(ref, np.ndarray):
      restored.append(np.asarray(x, dtype=ref.dtype))
    else:
      restored.append(jnp.asarray(x, dtype=ref.dtype))
  return jax.tree.unflatten(treedef, restored)


class Checkpointer:
  """``save(step, tree, host)``; ``restore(make_target)`` -> ``(step, tree, host)`` or None."""

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    # The newest `keep` steps, and step 0 for good: it is the run's starting point (the warm
    # start), which other runs load with `warmstart.init_from`.
    policy = preservation_policy.AnyPreservationPolicy(
        [preservation_policy.LatestN(keep), preservation_policy.CustomSteps([0])])
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(preservation_policy=policy,
                                             enable_async_checkpointing=async_save,
                                             create=True, cleanup_tmp_directories=True),
        item_names=("arrays", "host"))

  def save(self, step: int, tree, host: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardSave(_to_arrays(tree)), host=ocp.args.JsonSave(host)))

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, make_target: Callable[[dict], Any], step: int | None = None):
    """Newest restorable step (or exactly ``step``). ``make_target(host)`` builds a tree of the
    saved structure."""
    if step is not None:
      return step, *self._restore_step(step, make_target)
    for step in reversed(self.steps()):
      try:
        return step, *self._restore_step(step, make_target)
      except Exception as e:  # any unreadable/mismatched step: fall back to the previous one
        aside = os.path.join(self.directory + "_corrupt", str(step))
        warnings.warn(f"checkpoint step {step} in {self.directory} failed to restore "
                      f"({type(e).__name__}: {str(e)[:300]}); moved it to {aside} and trying the previous step",
                      RuntimeWarning, stacklevel=2)
        self._manager.wait_until_finished()
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        shutil.rmtree(aside, ignore_errors=True)
        shutil.move(os.path.join(self.directory, str(step)), aside)
        self._manager.reload()
    return None

  def _restore_step(self, step: int, make_target):
    host = self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore())).host
    target = make_target(host)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _to_arrays(target))
    arrays = self._manager.restore(
        step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))).arrays
    return _from_arrays(arrays, target), host

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

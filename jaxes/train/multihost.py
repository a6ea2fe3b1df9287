"""What a training run does differently when it spans several processes (``jaxes.distributed``).

Every process runs the same trainer: the same host-side controller and engine bookkeeping, fed
the same sandbox results in the same order (``EpisodeRunner``'s ``owned``/``exchange``), and the
same device programs over one global mesh. What differs per process:

- sandboxes: a process runs those of the slots whose rows live on its devices
  (``distributed.owned_rows``); the results are all-gathered once per engine tick;
- files: only the primary process writes metrics.jsonl, TensorBoard, summary.json, the plot,
  the progress bar and config.json (checkpoints are written by every process through orbax);
- arrays: the ES state lives on the global mesh in the rule table's shardings (the engine's;
  ``es_state_shardings``), each process holding its shards, so the ES update is one SPMD program
  and orbax saves and restores each process's shards. A single process with a multi-device mesh
  does the same, so it runs the very same programs as the multi-process run it is compared with.

A single-process run gets a ``Host`` with no exchange and its mesh from the config
(``builders.build_mesh``), as before.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxes import distributed
from jaxes.errors import ConfigError
from jaxes.models import partition
from jaxes.train import builders


@dataclasses.dataclass(frozen=True)
class Host:
  """This process's part in the run."""
  mesh: Mesh
  primary: bool                               # writes metrics, summaries, plots, config.json
  owned: range | None                         # slots whose sandboxes run here (None: all)
  exchange: Callable[[Any], list] | None      # allgather_host in a multi-process run

  @property
  def multi_process(self) -> bool:
    return self.exchange is not None

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())


def host(config) -> Host:
  """The mesh, ownership and exchange of this process (after ``distributed.initialize``)."""
  if jax.process_count() == 1:
    return Host(builders.build_mesh(config), True, None, None)
  shape = builders.mesh_shape(config, jax.device_count())
  if math.prod(shape) != jax.device_count():
    raise ConfigError(f"config.mesh: a multi-process run uses every device, but data x fsdp x tensor "
                      f"= {math.prod(shape)} of {jax.device_count()} (e.g. --config.mesh.data=-1)")
  if config.rollout.sandbox_steps <= 0:
    raise ConfigError("config.rollout.sandbox_steps: a multi-process run needs the deterministic "
                      "schedule (sandbox_steps > 0) so that every process takes each sandbox "
                      "result at the same engine step")
  mesh = distributed.global_mesh(*shape)
  return Host(mesh, distributed.is_primary(), distributed.owned_rows(mesh, config.rollout.num_slots),
              distributed.allgather_host)


def es_state_shardings(abstract_es_state, mesh: Mesh, model_config):
  """Where each leaf of an ES state (``algorithms.evolution.abstract_es_state``) lives on ``mesh``: the
  parameters, and every optimizer-state subtree shaped like them (Adam's moments), in the rule
  table's shardings, the engine's (``partition.param_shardings``: fsdp splits the embedding
  dimension, tensor the heads and MLP); the rest (step count, run key, version) replicated."""
  params = partition.param_shardings(model_config, mesh)
  structure = jax.tree.structure(params)
  replicated = NamedSharding(mesh, PartitionSpec())

  def like_params(tree) -> bool:
    return jax.tree.structure(tree) == structure

  return jax.tree.map(lambda sub: params if like_params(sub) else jax.tree.map(lambda _: replicated, sub),
                      abstract_es_state, is_leaf=like_params)


def shared(host_: Host, make: Callable[[], Any]) -> Any:
  """``make()`` run on the primary process only, its (small, picklable) value sent to all: for
  work whose result must be identical everywhere but need not be computed everywhere (oracle
  transcripts from sandboxes, whose output can vary)."""
  if not host_.multi_process:
    return make()
  return host_.exchange(make() if host_.primary else None)[0]


def primary_first(host_: Host, name: str, make: Callable[[], Any]) -> Any:
  """``make()`` on the primary, then on the others once it is done (for a step that writes
  into the shared run directory, e.g. building the tokenizer, which the others then load)."""
  if not host_.multi_process:
    return make()
  value = make() if host_.primary else None
  distributed.barrier(name)
  return value if host_.primary else make()


class NullWriter:
  """The metrics writer of a process that writes no metrics."""

  def write(self, record: dict) -> None:
    pass

  def close(self) -> None:
    pass

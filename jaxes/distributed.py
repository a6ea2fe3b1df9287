"""Multi-process start-up, the host-side exchange, and the global mesh.

Call ``initialize()`` first thing in a process (before any JAX computation). It decides from the
environment how the run was launched:

- ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (all three, plus an
  optional ``JAX_LOCAL_DEVICE_IDS``): explicit, what ``launch/local.sh`` and
  ``launch/gpu/slurm.sh`` set;
- a SLURM step with more than one task (``srun``): JAX's own SLURM detection;
- a Cloud TPU VM (libtpu installed and TPU device files present, or GKE's TPU variables): JAX's
  own TPU detection, which reads the slice's workers from the metadata server;
- ``JAXES_DISTRIBUTED=auto`` forces JAX's detection (any cluster JAX knows), ``=off`` forces a
  single process;
- otherwise a single process, and ``initialize()`` does nothing.

Failures stop the whole job in bounded time: every process heartbeats to the coordinator (process
0); when one stops (killed, preempted, hung machine), the coordination service tells the others,
which terminate within about ``heartbeat_timeout_s`` (if the coordinator itself dies they notice at
once). A process that raises exits at once instead of waiting at JAX's shutdown barrier for peers
that are blocked in a collective with it (which would take ``shutdown_timeout_s``).
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import pickle
import sys
import traceback
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh


EXPLICIT_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
DEFAULT_HEARTBEAT_TIMEOUT_S = 60
DEFAULT_SHUTDOWN_TIMEOUT_S = 120


class LaunchError(ValueError):
  """The environment describes a multi-process launch that cannot work (one line, names the
  variable)."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process was started. ``source`` is ``single``, ``env``, ``slurm``, ``tpu`` or
  ``auto``; the other fields are set only for ``env`` (JAX detects them otherwise)."""
  source: str
  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_device_ids: tuple[int, ...] | None = None

  @property
  def multi_process(self) -> bool:
    return self.source != "single"


def _int_var(env: Mapping[str, str], name: str) -> int:
  try:
    return int(env[name])
  except ValueError:
    raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def _on_cloud_tpu_vm(env: Mapping[str, str]) -> bool:
  if env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES"):
    return True   # GKE sets these on every TPU worker
  # A TPU VM has libtpu and its chips as /dev/accel* (v4, v5e, v5p) or VFIO groups (v6e); a CPU
  # machine with libtpu installed for AOT compilation has neither device file.
  has_chips = bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))
  return has_chips and importlib.util.find_spec("libtpu") is not None


def detect(env: Mapping[str, str] | None = None) -> Launch:
  """How the environment says this process was launched (pure apart from probing for TPU device
  files); raises ``LaunchError`` for half-set or malformed variables."""
  env = os.environ if env is None else env
  mode = env.get("JAXES_DISTRIBUTED", "").strip().lower()
  if mode not in ("", "auto", "off"):
    raise LaunchError(f"JAXES_DISTRIBUTED={mode!r}: expected 'auto', 'off' or unset")
  if mode == "off":
    return Launch("single")
  ids = None
  if env.get("JAX_LOCAL_DEVICE_IDS"):
    try:
      ids = tuple(int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(","))
    except ValueError:
      raise LaunchError(f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r}: expected "
                        f"comma-separated integers such as 0,1,2,3") from None
  present = [name for name in EXPLICIT_VARS if env.get(name)]
  if present:
    missing = [name for name in EXPLICIT_VARS if name not in present]
    if missing:
      raise LaunchError(f"{', '.join(present)} set but {', '.join(missing)} not: set all of "
                        f"{', '.join(EXPLICIT_VARS)} for a multi-process run, or none")
    address = env["JAX_COORDINATOR_ADDRESS"]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise LaunchError(f"JAX_COORDINATOR_ADDRESS={address!r}: expected HOST:PORT")
    count, index = _int_var(env, "JAX_NUM_PROCESSES"), _int_var(env, "JAX_PROCESS_ID")
    if count < 1 or not 0 <= index < count:
      raise LaunchError(f"JAX_PROCESS_ID={index} with JAX_NUM_PROCESSES={count}: need "
                        f"0 <= JAX_PROCESS_ID < JAX_NUM_PROCESSES")
    return Launch("env", address, count, index, ids)
  if mode == "auto":
    return Launch("auto", local_device_ids=ids)
  if env.get("SLURM_JOB_ID") and env.get("SLURM_NTASKS", "1") not in ("", "1"):
    if not (env.get("SLURM_STEP_NODELIST") and env.get("SLURM_PROCID")):
      raise LaunchError(f"SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not a task of "
                        f"an srun step (no SLURM_STEP_NODELIST/SLURM_PROCID): start it with srun")
    return Launch("slurm", local_device_ids=ids)
  if _on_cloud_tpu_vm(env):
    return Launch("tpu", local_device_ids=ids)
  if ids is not None:
    raise LaunchError("JAX_LOCAL_DEVICE_IDS is set but nothing describes a multi-process run "
                      f"(set {', '.join(EXPLICIT_VARS)} too)")
  return Launch("single")


_launch: Launch | None = None


def _timeout_s(given: int | None, name: str, default: int) -> int:
  if given is not None:
    return given
  value = os.environ.get(name, str(default))
  if not value.isdigit() or int(value) < 1:
    raise LaunchError(f"{name}={value!r}: expected a whole number of seconds >= 1")
  return int(value)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int | None = None,
               shutdown_timeout_s: int | None = None) -> Launch:
  """Join the multi-process run the environment describes, or do nothing for a single process.

  Idempotent. Must run before any JAX computation. The first three arguments (e.g. from command
  line flags) take the place of ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
  ``JAX_PROCESS_ID`` and are checked the same way. Timeouts default to
  ``JAXES_HEARTBEAT_TIMEOUT_S`` / ``JAXES_SHUTDOWN_TIMEOUT_S``, else 60 s / 120 s (JAX's own
  defaults are 100 s / 300 s).
  """
  global _launch
  if _launch is not None:
    return _launch
  given = dict(zip(EXPLICIT_VARS, (coordinator_address, num_processes, process_id)))
  launch = detect({**os.environ, **{k: str(v) for k, v in given.items() if v is not None}})
  if not launch.multi_process:
    _launch = launch
    return launch
  kwargs: dict[str, Any] = dict(
    heartbeat_timeout_seconds=_timeout_s(heartbeat_timeout_s, "JAXES_HEARTBEAT_TIMEOUT_S",
                                         DEFAULT_HEARTBEAT_TIMEOUT_S),
    shutdown_timeout_seconds=_timeout_s(shutdown_timeout_s, "JAXES_SHUTDOWN_TIMEOUT_S",
                                        DEFAULT_SHUTDOWN_TIMEOUT_S))
  if launch.local_device_ids is not None:
    kwargs["local_device_ids"] = list(launch.local_device_ids)
  if launch.source == "env":
    # 'deactivate': with everything given, JAX must not second-guess it (its SLURM detection
    # would otherwise restrict each process to the single GPU numbered SLURM_LOCALID).
    kwargs.update(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                  process_id=launch.process_id, cluster_detection_method="deactivate")
  if not jax.distributed.is_initialized():   # else the caller already joined
    # Cross-process collectives between CPU devices need a transport; gloo ships with jaxlib.
    # The option only concerns the CPU client, so it is harmless on GPU and TPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
      jax.distributed.initialize(**kwargs)
    except ValueError as e:   # JAX's detection found no coordinator / count / index
      raise LaunchError(f"launch looked like {launch.source!r} but JAX could not tell the "
                        f"coordinator, process count or index: {e}") from None
  sys.excepthook = _exit_at_once_on_error
  _launch = launch
  return launch


def _exit_at_once_on_error(kind, value, tb) -> None:
  """Uncaught exception in a multi-process run: print it, then leave without JAX's shutdown
  barrier, so the peers' heartbeat check (or their broken collectives) stops them promptly."""
  traceback.print_exception(kind, value, tb)
  abort(f"{kind.__name__}: {value}")


def abort(message: str, code: int = 1) -> None:
  """Print ``message`` naming this process and exit now with ``code`` (no shutdown barrier)."""
  index = jax.process_index() if _launch and _launch.multi_process else 0
  print(f"jaxes.distributed: process {index} failed: {message}; exiting so that the other "
        f"processes stop too", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_primary() -> bool:
  """The one process that writes metrics, summaries and plots."""
  return jax.process_index() == 0


def _bucket(n: int) -> int:
  """Padded payload length: powers of two from 256 bytes, so the gather compiles for a handful
  of shapes rather than once per distinct message length."""
  return max(256, 1 << (n - 1).bit_length())


# The payload room of the exchange: the same on every process, since each updates it from the
# same gathered lengths; it only grows, so a steady run pays one gather per exchange.
_room = _bucket(1)


def _gather_padded(payload: bytes, room: int) -> np.ndarray:
  buffer = np.zeros(8 + room, np.uint8)
  buffer[:8] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
  if len(payload) <= room:
    buffer[8:8 + len(payload)] = np.frombuffer(payload, np.uint8)
  return multihost_utils.process_allgather(buffer)


def allgather_host(obj: Any) -> list[Any]:
  """Every process's ``obj`` (small, picklable), as a list ordered by process index; the same
  list on every process. One ``process_allgather`` of a length header plus the payload padded to
  a shared room; a second, with a larger room, only when some payload does not fit."""
  global _room
  payload = pickle.dumps(obj, protocol=5)
  if jax.process_count() == 1:
    return [pickle.loads(payload)]   # a copy, as in the multi-process case
  gathered = _gather_padded(payload, _room)
  lengths = gathered[:, :8].copy().view(np.int64)[:, 0]
  if lengths.max() > _room:
    _room = _bucket(int(lengths.max()))
    gathered = _gather_padded(payload, _room)
  return [pickle.loads(gathered[i, 8:8 + int(n)].tobytes()) for i, n in enumerate(lengths)]


def place(tree, shardings):
  """``tree``'s arrays as global arrays in ``shardings`` (one ``Sharding`` for every leaf, or a
  pytree of them matching ``tree``), each process filling its own shards from its host copy
  (identical on every process); non-array leaves are kept. ``jax.device_put`` cannot do this
  for a mesh spanning processes from a host value (nor for typed keys)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)

  def put(x, sharding):
    if not isinstance(x, (jax.Array, np.ndarray)):
      return x
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and (sharding.is_fully_addressable or not x.is_fully_addressable):
      return jax.device_put(x, sharding)   # within one process, or global to global
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
  return jax.tree.map(put, tree, shardings)


def barrier(name: str) -> None:
  """Wait until every process reaches ``barrier(name)``; a name mismatch raises."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _row_processes(mesh: Mesh) -> list[tuple[int, ...]]:
  return [tuple(sorted({d.process_index for d in row.flat})) for row in mesh.devices]


def follows_processes(rows: Sequence[tuple[int, ...]]) -> bool:
  """Whether a layout, given as the sorted process indices holding each ``data`` index, is one
  ``global_mesh`` accepts: each index on one process or on processes holding nothing else, in
  process order."""
  for a, b in zip(rows, rows[1:]):
    if a[-1] > b[0]:
      return False
    if set(a) & set(b) and (len(a) > 1 or a != b):
      return False
  return True


def global_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1) -> Mesh:
  """One (data, fsdp, tensor) mesh over every process's devices.

  Ordering: along ``data``, process 0's shards come first, then process 1's, and so on. When
  ``fsdp * tensor`` is at most a process's device count, each ``data`` index lies entirely on one
  process (process p holds indices ``[p*k, (p+1)*k)``, ``k = data / process_count``); when it is
  larger, each index spans ``fsdp * tensor / local_device_count`` consecutive processes that hold
  nothing else. ``jax.make_mesh``'s topology-aware order is kept when it already has this
  property; otherwise devices are taken in (process, id) order.
  """
  from jaxes.sharding import MESH_AXES, make_mesh  # imports flax; initialize() need not wait
  mesh = make_mesh(data, fsdp, tensor)
  if follows_processes(_row_processes(mesh)):
    return mesh
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.asarray(devices, dtype=object).reshape(data, fsdp, tensor), MESH_AXES,
              axis_types=(AxisType.Auto,) * 3)
  if not follows_processes(_row_processes(mesh)):
    raise ValueError(f"mesh fsdp={fsdp} x tensor={tensor} = {fsdp * tensor} devices per data "
                     f"shard neither divides nor is a multiple of the {jax.local_device_count()} "
                     f"devices per process, so data shards would straddle processes")
  return mesh


def data_shard_owners(mesh: Mesh) -> tuple[int, ...]:
  """The process that owns each index along ``data`` (runs its slots' sandboxes): the lowest
  process holding it."""
  return tuple(procs[0] for procs in _row_processes(mesh))


def owned_rows(mesh: Mesh, batch_size: int, process: int | None = None) -> range:
  """The rows of a ``batch_size`` batch sharded over ``data`` that ``process`` (default: this
  one) owns; contiguous by ``global_mesh``'s ordering, possibly empty."""
  process = jax.process_index() if process is None else process
  data = mesh.shape["data"]
  if batch_size % data:
    raise ValueError(f"batch of {batch_size} rows does not split over mesh data={data}")
  per = batch_size // data
  mine = [i for i, owner in enumerate(data_shard_owners(mesh)) if owner == process]
  if not mine:
    return range(0)
  if mine != list(range(mine[0], mine[-1] + 1)):
    raise ValueError(f"process {process} owns data shards {mine}, not a contiguous run; build "
                     f"the mesh with global_mesh")
  return range(mine[0] * per, (mine[-1] + 1) * per)

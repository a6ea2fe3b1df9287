"""The attention kernels JAX ships, on their targets' platforms: the path is picked for the mesh's
devices (a deviceless TPU or GPU compile from this CPU process builds the real run's program);
pages interleaved as ``ragged_paged_attention`` reads them are written and read (portable path)
as split ones; the TPU path's inputs to the kernel (flat ragged queries, lengths, page ids) give
the portable path's attention through JAX's own plain-JAX reference of that layout; a v5p
lowering carries the Pallas kernel, and the kernel itself matches the portable path where it
can run (a TPU)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxes import gpu_targets
from jaxes.models import attention, kernels_tpu
from jaxes.models.attention import dispatch


L, K, G, hd, PAGE, WIDTH = 2, 2, 2, 8, 4, 4   # S = WIDTH * PAGE = 16 slots per row


def paged_case(seed=0, dtype=jnp.float32):
  """Three rows of a 12-page pool: a prefill chunk of 3 tokens after 5 cached slots, a decode
  token after 10, and an empty row (all padding), as the engine lays them out (real tokens
  leading, padding querying slot 0). Returns the attend arguments."""
  r = np.random.default_rng(seed)
  pages_k, pages_v = (jnp.asarray(r.normal(size=(L, 12, PAGE, K, hd)), dtype) for _ in range(2))
  table = jnp.asarray([[3, 7, 1, 0], [5, 2, 9, 11], [4, 6, 8, 10]], jnp.int32)
  index, counts, T = np.array([5, 10, 0]), np.array([3, 1, 0]), 3
  t = np.arange(T)[None, :]
  q_slots = np.where(t < counts[:, None], index[:, None] + t, 0)
  valid = np.arange(WIDTH * PAGE)[None, :] < (index + counts)[:, None]
  q = jnp.asarray(r.normal(size=(3, T, K, G, hd)), dtype)
  return q, pages_k, pages_v, table, jnp.asarray(valid), jnp.asarray(q_slots, jnp.int32), counts


def paged_attend(table, addressing, dtype=None, platform=None, mesh=None):
  """``attend(q, pages_k, pages_v, layer, valid, q_slots)`` through ``attention.Pages(table)``
  (on ``mesh``'s data x tensor), with ``addressing``'s static fields, by the table's
  implementation for ``platform`` (None: the mesh's)."""
  def attend(q, pages_k, pages_v, layer, valid, q_slots):
    access = attention.Pages(table) if mesh is None else attention.Pages(table, mesh, "data", "tensor")
    at = dataclasses.replace(addressing, valid=valid, q_slots=q_slots)
    cache = attention.layer_cache(pages_k, pages_v, access, at, dtype)
    if platform is not None:
      cache = dataclasses.replace(cache, impl=dispatch.choose(platform, access.cache_kind(pages_v)))
    return cache.attend(q, layer)
  return attend


def test_ragged_runs_are_the_kernels_sequences():
  # a padded batch [n, T]: a prefill of 3 after 5 slots, a decode token, an empty row; padding
  # queries slot 0 (bounded) and is a run of its own
  table = jnp.asarray([[3, 7, 1, 0], [5, 2, 9, 11], [4, 6, 8, 10]], jnp.int32)
  q_slots = jnp.asarray([[5, 6, 7], [10, 0, 0], [0, 0, 0]], jnp.int32)
  kv_lens, seq_rows, cu, num = jax.jit(kernels_tpu.ragged_runs)(q_slots, table)
  assert int(num[0]) == 7
  np.testing.assert_array_equal(cu, [0, 3, 4, 5, 6, 7, 8, 9, 9, 9])
  np.testing.assert_array_equal(kv_lens, [8, 11, 1, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(seq_rows[:7], [0, 1, 1, 1, 2, 2, 2])
  # the engine's flat buffer (one token per batch row): a row's chunk is one run across batch
  # rows of an equal page table; the next slot of other pages, or a repeated slot, is not
  flat_table = table[jnp.asarray([0, 0, 0, 1, 2, 0, 0])]
  flat = jnp.asarray([[5], [6], [7], [8], [9], [8], [8]], jnp.int32)
  kv_lens, seq_rows, cu, num = jax.jit(kernels_tpu.ragged_runs)(flat, flat_table)
  assert int(num[0]) == 5
  np.testing.assert_array_equal(cu[:6], [0, 3, 4, 5, 6, 7])
  np.testing.assert_array_equal(kv_lens[:5], [8, 9, 10, 9, 9])
  np.testing.assert_array_equal(seq_rows[:5], [0, 3, 4, 5, 6])


def interleaved(pages_k, pages_v):
  """The interleaved layout of split pages, and its empty values placeholder."""
  combined = kernels_tpu.combined_pages(pages_k, pages_v)
  return combined, jnp.zeros(combined.shape[:3] + (0, combined.shape[4]), combined.dtype)


def test_combined_pages_interleave_keys_and_values_per_head():
  _, pages_k, pages_v, *_ = paged_case(dtype=jnp.bfloat16)
  combined, empty = interleaved(pages_k, pages_v)
  assert combined.shape == (L, 12, PAGE, 2 * K, hd) and attention.interleaved(empty)
  assert not attention.interleaved(pages_v)
  np.testing.assert_array_equal(combined[..., 0::2, :], pages_k)
  np.testing.assert_array_equal(combined[..., 1::2, :], pages_v)


def test_a_write_into_interleaved_pages_is_the_split_write_interleaved():
  _, pages_k, pages_v, table, _, q_slots, counts = paged_case()
  r = np.random.default_rng(1)
  k, v = (jnp.asarray(r.normal(size=(3, 3, K, hd)), jnp.float32) for _ in range(2))
  slots = jnp.where(jnp.arange(3)[None] < jnp.asarray(counts)[:, None], q_slots, WIDTH * PAGE)

  @jax.jit
  def write(pages_k, pages_v, layer, slots, k, v):
    cache = attention.layer_cache(pages_k, pages_v, attention.Pages(table),
                                  attention.Addressing(None, None, WIDTH * PAGE, slots))
    return cache.access.write(cache, layer, k, v)
  split = write(pages_k, pages_v, jnp.int32(1), slots, k, v)
  mixed = write(*interleaved(pages_k, pages_v), jnp.int32(1), slots, k, v)
  assert not np.array_equal(split[0], pages_k)   # something was written
  np.testing.assert_array_equal(mixed[0], kernels_tpu.combined_pages(*split))
  assert mixed[1].shape[3] == 0


def flat_case(q, table, q_slots, counts):
  """``paged_case``'s real tokens as the engine's flat buffer: one token per batch row, each with
  its row's page table (a row's chunk as consecutive tokens)."""
  rows = np.concatenate([np.full(c, i) for i, c in enumerate(counts)])
  at = np.concatenate([np.arange(c) for c in counts])
  return (q[rows, at][:, None], table[rows], q_slots[rows, at][:, None],
          np.ones(len(rows), int))


@pytest.mark.parametrize("layout", ["padded", "flat"])
def test_the_kernels_inputs_give_the_portable_paths_attention(layout):
  """Through ``ref_ragged_paged_attention`` (the kernel's layout in plain JAX): what the kernel
  would compute from the tables, lengths and interleaved pages built here is the portable path's
  output, and the portable path reads interleaved pages as it reads split ones; for a padded
  batch and for the engine's flat one (a chunk's tokens one run across batch rows)."""
  q, pages_k, pages_v, table, valid, q_slots, counts = paged_case()
  if layout == "flat":
    q, table, q_slots, counts = flat_case(q, table, q_slots, counts)
    valid = jnp.arange(WIDTH * PAGE)[None, :] <= q_slots
  layer = jnp.int32(1)
  attend = jax.jit(paged_attend(table, attention.Addressing(
      None, None, span=WIDTH * PAGE, bounded=True, block=2 * PAGE)))
  portable = np.asarray(attend(q, pages_k, pages_v, layer, valid, q_slots))
  combined, empty = interleaved(pages_k, pages_v)
  real = np.arange(q.shape[1])[None, :] < counts[:, None]
  np.testing.assert_allclose(np.asarray(attend(q, combined, empty, layer, valid, q_slots))[real],
                             portable[real], rtol=1e-6, atol=1e-6)
  inputs = jax.jit(kernels_tpu.kernel_inputs)(q, combined, layer, q_slots, table)
  queries, kv_pages, *lengths = inputs   # the lengths as constants: the reference loops over them
  lengths = [np.asarray(x) for x in lengths]
  assert lengths[-1][0] == (7 if layout == "padded" else 2)   # runs: the prefill chunk is one
  out = jax.jit(lambda queries, kv_pages: kernels_tpu.reference(queries, kv_pages, *lengths,
                                                                sm_scale=hd ** -0.5))(queries, kv_pages)
  np.testing.assert_allclose(np.asarray(out).reshape(q.shape)[real], portable[real],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.hardware
@pytest.mark.skipif(jax.default_backend() != "tpu", reason=(
    "needs a TPU: JAX 0.10.2's TPU interpret mode (pltpu.force_tpu_interpret_mode) cannot run "
    "ragged_paged_attention: its interpreter models indexed refs only and fails on the kernel's "
    "ref reshape ('ReshapeTransform' object has no attribute 'indices')"))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_a_tpu_the_kernel_matches_the_portable_path(dtype):
  q, pages_k, pages_v, table, valid, q_slots, counts = paged_case(dtype=dtype)
  bits = tuple(attention.as_bits(x) for x in interleaved(pages_k, pages_v))
  layer = jnp.int32(1)
  attend = lambda platform: jax.jit(paged_attend(
      table, attention.Addressing(None, None, span=WIDTH * PAGE), dtype, platform))(
          q, *bits, layer, valid, q_slots)
  real = np.arange(q.shape[1])[None, :] < counts[:, None]
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(np.asarray(attend("tpu"), np.float32)[real],
                             np.asarray(attend("cpu"), np.float32)[real], rtol=tol, atol=tol)


def test_the_platform_is_the_meshs_not_the_processs():
  assert attention.target_platform() == jax.default_backend() == "cpu"
  assert attention.target_platform(Mesh(np.array(jax.devices()[:1]), ("data",))) == "cpu"


def _paged_attend_lowering(mesh, heads=(4, 0)):
  """``Pages.attend`` under ``jit`` on ``mesh`` (data x tensor), bfloat16 pages as raw bits with
  ``heads`` KV heads per tensor shard in the keys' and values' arrays (interleaved: (4, 0), 2
  KV heads a shard; split: (2, 2))."""
  data, tensor = mesh.devices.shape
  n, T, S, pages = 2 * data, 2, 8 * 16, 8 * data
  shape = lambda shp, dt, spec: jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, spec))
  cache = P(None, "data", None, "tensor", None)
  args = (shape((n, T, 2 * tensor, 2, 128), jnp.bfloat16, P("data", None, "tensor")),
          shape((2, pages, 16, heads[0] * tensor, 128), jnp.uint16, cache),
          shape((2, pages, 16, heads[1] * tensor, 128), jnp.uint16, cache),
          shape((), jnp.int32, P()), shape((n, S), bool, P("data")),
          shape((n, T), jnp.int32, P("data")), shape((n, S // 16), jnp.int32, P("data")))

  def attend(q, pk, pv, layer, valid, q_slots, table):
    return paged_attend(table, attention.Addressing(None, None, span=S, bounded=True),
                        jnp.bfloat16, mesh=mesh)(q, pk, pv, layer, valid, q_slots)
  return jax.jit(attend).lower(*args)


@pytest.mark.libtpu
def test_a_v5p_lowering_of_interleaved_pages_carries_the_pallas_kernel(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock
  from jax.experimental import topologies
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  tpu = Mesh(np.array(devices).reshape(2, 2), ("data", "tensor"))
  assert attention.target_platform(tpu) == "tpu" and attention.interleave_pages(tpu)
  text = _paged_attend_lowering(tpu).as_text()
  assert "tpu_custom_call" in text and "ragged_paged_attention_kernel" in text
  # split pages stay on blockwise (the kernel's layout built at the call costs more than it saves)
  assert "tpu_custom_call" not in _paged_attend_lowering(tpu, heads=(2, 2)).as_text()
  cpu = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  assert not attention.interleave_pages(cpu)
  assert "tpu_custom_call" not in _paged_attend_lowering(cpu).as_text()


def _cudnn_missing():
  from jax._src.lib import cuda_versions   # what jax.nn.dot_product_attention asks (no public API)
  try:
    return cuda_versions is None or cuda_versions.cudnn_get_version() is None
  except RuntimeError:
    return True


@pytest.mark.hardware
@pytest.mark.cuda_plugin
def test_a_gpu_target_is_the_gpu_platform_and_its_lowering_asks_cudnn():
  devices = gpu_targets.devices("1xH100")
  mesh = Mesh(np.array(devices).reshape(1, 1), ("data", "tensor"))
  assert attention.target_platform(mesh) == "gpu"
  if _cudnn_missing():
    # jax.nn.dot_product_attention(implementation="cudnn") asks the cuDNN library for its version
    # while tracing ("RuntimeError: cuDNN not found." without the nvidia-cudnn wheels of the
    # with-cuda extra), so here the GPU-target program is the blockwise one.
    pytest.skip("cuDNN is not installed: a GPU-target lowering falls back to blockwise; "
                + gpu_targets.CUDNN_HINT)
  spec = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, P()))
  rows = attention.Rows(jnp.arange(2), mesh, "data", "tensor")
  text = jax.jit(lambda q, c, valid, q_slots: attention.layer_cache(
      c, c, rows, attention.Addressing(valid, q_slots, span=64), jnp.bfloat16).attend(q, jnp.int32(0))
                 ).lower(spec((2, 1, 2, 2, 128), jnp.bfloat16), spec((1, 2, 64, 2, 128), jnp.uint16),
                         spec((2, 64), bool), spec((2, 1), jnp.int32)).as_text()
  assert "cudnn" in text


def test_a_forward_over_interleaved_pages_gives_the_split_pages_logits():
  from helpers_models import tiny_model
  from jaxes.models import qwen2
  cfg, graphdef, params = tiny_model()
  step = jax.jit(lambda cache, tokens, valid: qwen2.forward(
      graphdef, params, tokens, cache.index[:, None] + jnp.cumsum(valid, 1) - 1, valid, cache=cache,
      options=qwen2.Options(access=attention.Pages(cache.table))))
  r = np.random.default_rng(0)
  prompt = jnp.asarray(r.integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
  valid = jnp.asarray([[True] * 6, [True] * 3 + [False] * 3])
  logits = {}
  for layout in (False, True):
    cache = qwen2.PagedKVCache.init(cfg, 2, 16, 4, 8, interleaved=layout)
    cache = dataclasses.replace(cache, table=jnp.asarray([[5, 2, 7, 0], [1, 6, 3, 4]], jnp.int32))
    first, cache = step(cache, prompt, valid)
    one = jnp.arange(6)[None, :] < 1   # a decode token each, at the same width (one program)
    second, cache = step(cache, prompt, jnp.broadcast_to(one, (2, 6)))
    logits[layout] = np.concatenate([np.asarray(first)[np.asarray(valid)], np.asarray(second)[:, 0]])
  assert qwen2.PagedKVCache.init(cfg, 2, 16, 4, 8, interleaved=True).v.shape[3] == 0
  np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)


@pytest.mark.libtpu
def test_a_forward_over_an_interleaved_cache_compiles_for_v5p_with_the_kernel(monkeypatch):
  """The layer scan carrying interleaved pages, written by ``Pages.write`` and read by the kernel
  per shard (data 2 x tensor 2), through the TPU compiler (head_dim 128, as Mosaic tiles it)."""
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from flax import nnx
  from jax.experimental import topologies
  from jaxes.models import qwen2
  mesh = Mesh(np.array(topologies.get_topology_desc("v5p:2x2x1", "tpu").devices).reshape(2, 2),
              ("data", "tensor"))
  cfg = qwen2.Qwen2Config.preset("tiny-gqa", dtype="bfloat16", head_dim=128)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)
  placed = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  params = jax.tree.map(lambda x: placed(x, P()), params)
  cache = jax.eval_shape(lambda: qwen2.PagedKVCache.init(cfg, 4, 64, 16, 16, interleaved=True))
  pages = P(None, "data", None, "tensor", None)
  cache = dataclasses.replace(cache, k=placed(cache.k, pages), v=placed(cache.v, pages),
                              index=placed(cache.index, P("data")), valid=placed(cache.valid, P("data")),
                              table=placed(cache.table, P("data")))
  tokens = jax.ShapeDtypeStruct((4, 2), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  valid = jax.ShapeDtypeStruct((4, 2), bool, sharding=NamedSharding(mesh, P("data")))

  def step(params, cache, tokens, positions, valid):
    return qwen2.forward(graphdef, params, tokens, positions, valid, cache=cache, options=qwen2.Options(
        bounded_keys=True, access=attention.Pages(cache.table, mesh, "data", "tensor")))
  lowered = jax.jit(step).lower(params, cache, tokens, tokens, valid)
  assert "ragged_paged_attention_kernel" in lowered.as_text()
  assert lowered.compile().memory_analysis().temp_size_in_bytes > 0

"""The attention dispatch table (``jaxes.models.attention.dispatch``): platform names, the most
specific entry wins, a kernel registered in one line is what the model's cached forward runs,
and the engine's attention spans, paged layout and the preflight's name for the path follow
from the table."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh

from jaxes.models import attention, qwen2
from jaxes.models.attention import dispatch
from helpers_models import tiny_model


def test_platform_names_fold_the_gpu_plugins():
  assert [dispatch.platform_name(n) for n in ("cuda", "ROCM", "gpu", "tpu", "cpu")] == [
      "gpu", "gpu", "gpu", "tpu", "cpu"]


def test_the_built_in_entries():
  names = {(p, c): dispatch.choose(p, c).name
           for p in ("cpu", "cuda", "tpu") for c in dispatch.CACHE_KINDS}
  assert {names[("cpu", c)] for c in ("dense", "paged", "paged_interleaved")} == {"blockwise"}
  assert {names[(p, "none")] for p in ("cpu", "cuda", "tpu")} == {"causal"}
  assert names[("cuda", "dense")] == names[("cuda", "paged")] == "cuDNN"
  assert names[("tpu", "paged_interleaved")] == "ragged_paged_attention"
  assert names[("tpu", "paged")] == names[("tpu", "dense")] == "blockwise"
  with pytest.raises(ValueError, match="unknown cache kind 'rows'"):
    dispatch.choose("cpu", "rows")
  with pytest.raises(ValueError, match="unknown cache kind 'train'"):
    dispatch.register("cpu", "train", attention.BLOCKWISE)


@pytest.fixture
def registered():
  """Registers entries for the test and puts back what they replaced after it, whatever
  happens."""
  replaced = []

  def register(platform, cache, impl):
    key = (platform, cache)
    before = dispatch.entries().get(key) and dispatch.choose(*key)
    replaced.append((key, before))
    dispatch.register(platform, cache, impl)
  yield register
  for key, before in reversed(replaced):
    dispatch.unregister(*key)
    if before:
      dispatch.register(*key, before)


def test_a_key_without_an_entry_names_the_table():
  blockwise = dispatch.choose("*", "dense")
  dispatch.unregister("*", "dense")
  try:
    with pytest.raises(ValueError, match="no attention implementation for platform 'cpu', cache 'dense'"):
      dispatch.choose("cpu", "dense")
  finally:
    dispatch.register("*", "dense", blockwise)


def test_a_kernel_registered_in_one_line_runs_in_the_cached_forward(registered):
  """A one-softmax kernel for CPU's dense caches: the cached forward's steps run it (and the
  uncached one does not), with the blockwise path's logits."""
  widths = []

  def one_softmax(q, keys):
    widths.append(q.shape[1])
    k, v = keys.read(0, keys.span)
    return attention.dense(q, k, v, keys.visible(0, keys.span))

  cfg, graphdef, params = tiny_model(vocab_size=61)
  B, T, S = 2, 4, 8
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(T + 1), (B, T + 1))
  ones = jnp.ones((B, T), bool)

  def decode_logits():
    _, cache = qwen2.forward(graphdef, params, tokens[:, :T], positions[:, :T], ones,
                             qwen2.KVCache.init(cfg, B, S))
    return qwen2.forward(graphdef, params, tokens[:, T:], positions[:, T:], ones[:, :1], cache)[0]

  reference = decode_logits()
  assert widths == []
  registered("cpu", "dense", dispatch.Implementation("one softmax", one_softmax))
  assert dispatch.choose("cpu", "paged").name == "blockwise"
  got = decode_logits()
  assert widths == [T, 1]   # traced once per call, in the layer scan: the prefill, the decode step
  qwen2.forward(graphdef, params, tokens[:, :T], positions[:, :T], ones)   # no cache
  assert widths == [T, 1]
  np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-5, rtol=0)


def test_the_engines_spans_page_layout_and_named_path_follow_the_table(registered):
  cpu = Mesh(np.array(jax.devices()[:1]), ("data",))
  cfg = qwen2.Qwen2Config.preset("tiny")
  dense = jax.eval_shape(lambda: qwen2.KVCache.init(cfg, 2, 64))
  split = jax.eval_shape(lambda: qwen2.PagedKVCache.init(cfg, 2, 64, 16, 8))
  interleaved = jax.eval_shape(lambda: qwen2.PagedKVCache.init(cfg, 2, 64, 16, 8, interleaved=True))
  assert [dispatch.cache_kind(c) for c in (dense, split, interleaved)] == [
      "dense", "paged", "paged_interleaved"]
  assert attention.attention_spans(64, cpu) == [64] and not attention.interleave_pages(cpu)
  assert attention.describe(cpu, dense) == attention.describe(cpu, split) == "blockwise"
  registered("cpu", "dense", attention.CUDNN)   # reads the whole span it is handed
  assert attention.attention_spans(64, cpu) == [16, 32, 64]
  assert attention.attention_spans(64, cpu, paged=True) == [64]
  registered("cpu", "paged_interleaved",
             dispatch.Implementation("interleaved kernel", attention.BLOCKWISE.fn))
  assert attention.interleave_pages(cpu)
  assert attention.describe(cpu, interleaved) == "interleaved kernel"
  assert attention.describe(cpu, dense) == "cuDNN (unpaged cache; rollout.page_size for interleaved kernel)"

"""The attention dispatch table (``jaxes.models.attention_dispatch``): platform names, the most
specific entry wins, a kernel registered in one line is what the model's forward runs, and the
engine's attention spans and paged layout follow from the table."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh

from jaxes.models import attention, qwen2
from jaxes.models import attention_dispatch as dispatch
from helpers_models import tiny_model


def test_platform_names_fold_the_gpu_plugins():
  assert [dispatch.platform_name(n) for n in ("cuda", "ROCM", "gpu", "tpu", "cpu")] == [
      "gpu", "gpu", "gpu", "tpu", "cpu"]


def test_the_built_in_entries():
  names = {(p, c, ph): dispatch.choose(p, c, ph).name
           for p in ("cpu", "cuda", "tpu") for c in dispatch.CACHE_KINDS for ph in dispatch.PHASES}
  assert {names[("cpu", c, "mixed")] for c in ("dense", "paged", "paged_interleaved")} == {"blockwise"}
  assert {names[(p, "none", "prefill")] for p in ("cpu", "cuda", "tpu")} == {"causal"}
  assert names[("cuda", "dense", "decode")] == names[("cuda", "paged", "mixed")] == "cuDNN"
  assert names[("tpu", "paged_interleaved", "decode")] == "ragged_paged_attention"
  assert names[("tpu", "paged", "mixed")] == names[("tpu", "dense", "mixed")] == "blockwise"
  with pytest.raises(ValueError, match="no attention implementation for platform 'cpu', cache 'rows'"):
    dispatch.choose("cpu", "rows", "decode")
  with pytest.raises(ValueError, match="unknown attention phase 'train'"):
    dispatch.register("cpu", "dense", "train", attention.BLOCKWISE)


@pytest.fixture
def registered():
  """Registers entries for the test and removes them after it, whatever happens."""
  added = []

  def register(platform, cache, phase, impl):
    dispatch.register(platform, cache, phase, impl)
    added.append((platform, cache, phase))
  yield register
  for key in added:
    dispatch.unregister(*key)


def test_a_kernel_registered_in_one_line_runs_in_the_cached_forward(registered):
  """A one-softmax kernel for CPU decode steps: the forward's decode step runs it (and nothing
  else does), with the blockwise path's logits."""
  phases = []

  def one_softmax(q, keys):
    phases.append(q.shape[1])
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
  assert phases == []
  registered("cpu", "dense", "decode", dispatch.Implementation("one softmax", one_softmax))
  assert dispatch.choose("cpu", "dense", "prefill").name == "blockwise"
  got = decode_logits()
  assert phases == [1]   # traced once, in the layer scan of the one-token step
  np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-5, rtol=0)


def test_the_engines_spans_and_page_layout_follow_the_table(registered):
  cpu = Mesh(np.array(jax.devices()[:1]), ("data",))
  assert attention.attention_spans(64, cpu) == [64] and not attention.interleave_pages(cpu)
  registered("cpu", "dense", "mixed", attention.CUDNN)   # reads the whole span it is handed
  assert attention.attention_spans(64, cpu) == [16, 32, 64]
  assert attention.attention_spans(64, cpu, paged=True) == [64]
  registered("cpu", "paged_interleaved", "*",
             dispatch.Implementation("interleaved kernel", attention.BLOCKWISE.fn))
  assert attention.interleave_pages(cpu)

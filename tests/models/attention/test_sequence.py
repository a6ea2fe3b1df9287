"""The uncached forward's attention (``jaxes.models.attention.sequence``) and remat: ``causal`` (blockwise over query blocks
when the sequence is long) equals the dense softmax, and ``qwen2.Options(remat=True)`` equals the
plain forward, in logits and gradients at float32; both lower the gradient's compiled memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_models import tiny_model

from jaxes.models import attention, qwen2
from jaxes.models.attention import sequence, softmax


def dense_causal(q, k, v, valid):
  T = valid.shape[1]
  return attention.dense(q, k, v, valid[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None])


def qkv(B, T, K, G, hd, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, T, K, G, hd)), jax.random.normal(kk, (B, T, K, hd)),
          jax.random.normal(kv, (B, T, K, hd)))


# right padding, left padding, a hole, and a row with a single real token
VALID = np.ones((4, 13), bool)
VALID[0, 9:] = False
VALID[1, :5] = False
VALID[2, 6] = False
VALID[3, 1:] = False


@pytest.mark.parametrize("T,block", [(13, 4), (12, 4), (13, 32)])  # padded up, exact, dense
def test_causal_equals_dense_in_values_and_gradients(T, block):
  q, k, v = qkv(4, T, 2, 2, 8)
  valid = jnp.asarray(VALID[:, :T])
  out = sequence.causal(q, k, v, valid, block=block)
  ref = dense_causal(q, k, v, valid)
  real = np.asarray(valid)   # a padding query sees no key: its output is arbitrary
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)
  cot = jax.random.normal(jax.random.key(1), q.shape) * valid[:, :, None, None, None]
  grads = jax.grad(lambda *a: jnp.sum(cot * sequence.causal(*a, valid, block=block)), (0, 1, 2))(q, k, v)
  refs = jax.grad(lambda *a: jnp.sum(cot * dense_causal(*a, valid)), (0, 1, 2))(q, k, v)
  for g, r in zip(grads, refs):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_causal_gradient_holds_one_query_block_of_scores():
  """The compiled gradient's temporaries stay well below the dense [B, K, G, T, T] scores."""
  q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(1, 2048, 1, 4, 16))
  valid = jax.ShapeDtypeStruct((1, 2048), bool)

  def temp(fn):
    loss = lambda q, k, v, m: jnp.sum(fn(q, k, v, m) ** 2)
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v, valid).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  scores = 4 * 2048 * 2048 * 4   # one float32 [G, T, T]
  assert temp(dense_causal) >= scores
  assert temp(lambda *a: sequence.causal(*a, block=256)) < scores / 2


@pytest.fixture(scope="module")
def model():
  return tiny_model("tiny-gqa", seed=3, num_layers=3)


def logprob_sum(graphdef, tokens, valid, remat):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  weights = jax.random.normal(jax.random.key(5), (*tokens.shape, 1))

  def f(params):
    logits, _ = qwen2.forward(graphdef, params, tokens, positions, valid,
                              options=qwen2.Options(remat=remat))
    return jnp.sum(weights * jax.nn.log_softmax(logits) * valid[..., None]), logits
  return f


def batch(cfg, T=40):
  tokens = jax.random.randint(jax.random.key(2), (3, T), 0, cfg.vocab_size)
  valid = np.ones((3, T), bool)
  valid[1, 29:] = False
  valid[2, :7] = False
  return tokens, jnp.asarray(valid)


def test_forward_blockwise_and_remat_equal_dense_plain(model, monkeypatch):
  cfg, graphdef, params = model
  tokens, valid = batch(cfg)
  (ref_value, ref_logits), ref_grads = jax.value_and_grad(
      logprob_sum(graphdef, tokens, valid, remat=False), has_aux=True)(params)   # dense (T <= 512)
  monkeypatch.setattr(softmax, "KV_BLOCK", 16)   # 40 tokens: three query blocks, padded to 48
  for remat in (False, True):
    (value, logits), grads = jax.value_and_grad(
        logprob_sum(graphdef, tokens, valid, remat=remat), has_aux=True)(params)
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):   # float32 sums of ~6e4 terms
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * float(np.abs(r).max()))


def test_remat_equals_plain_and_lowers_the_gradient_memory(model):
  cfg, graphdef, params = model
  tokens, valid = batch(cfg, T=256)
  out = {}
  for remat in (False, True):
    fn = jax.jit(jax.grad(logprob_sum(graphdef, tokens, valid, remat), has_aux=True))
    out[remat] = fn(params)[0], fn.lower(params).compile().memory_analysis().temp_size_in_bytes
  for g, r in zip(jax.tree.leaves(out[True][0]), jax.tree.leaves(out[False][0])):
    # equal up to float rounding (the recomputed forward fuses differently: not bit for bit)
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * float(np.abs(r).max()))
  assert out[True][1] < out[False][1], f"remat temporaries {out[True][1]} >= {out[False][1]}"

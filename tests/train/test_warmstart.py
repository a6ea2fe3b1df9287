"""The warm start: its loss weights, and a gradient that is correct and has the same bits
whatever the process's CPU device count (a 2-process rehearsal starts from the warm start of its
1-process run)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_models import tiny_tokenizer

from jaxes.models.noiser import FixedOrderGradNoiser, IdentityNoiser
from jaxes.rollout import chat
from jaxes.train import warmstart

# The attention projections' kernel gradients of the demo's model shapes: long contractions into
# small outputs, the ones XLA:CPU splits by thread count (the MLP's larger ones it does not).
GRADIENT_BITS = textwrap.dedent("""
    import hashlib
    import jax, numpy as np
    from flax import nnx
    from jaxes.models import qwen2
    from jaxes.train import warmstart
    cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=1024, hidden_size=128, intermediate_size=384,
                                   num_layers=2, num_heads=4, num_kv_heads=2)
    graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 1024, size=(4, 256)).astype(np.int32)
    weights = (rng.random((4, 256)) < 0.3).astype(np.float32)
    step = jax.jit(lambda p, t, w: warmstart.loss_and_grads(p, graphdef, t, w))
    loss, grads = step(params, tokens, weights)
    assert jax.local_device_count() == {devices}
    print("BITS", hashlib.md5(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves((loss, grads)))).hexdigest())
""")


def _gradient_bits(devices: int) -> str:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", GRADIENT_BITS.format(devices=devices)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("BITS"))


@pytest.mark.end_to_end
def test_warm_start_gradient_bits_do_not_depend_on_the_device_count():
  assert _gradient_bits(1) == _gradient_bits(8)


@pytest.mark.parametrize("rows,bias", [((3, 50), False), ((2, 128), True), ((7,), True)])
def test_fixed_order_gradients_equal_the_plain_ones(rows, bias):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((*rows, 24)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
  b = jnp.asarray(rng.standard_normal(40), jnp.float32) if bias else None
  target = jnp.asarray(rng.standard_normal((*rows, 40)), jnp.float32)

  def loss(noiser, x, kernel, b):
    return jnp.sum(jnp.sin(noiser.dense(x, kernel, b, name="k")) * target)

  fixed = jax.grad(loss, argnums=(1, 2, 3))(FixedOrderGradNoiser(chunk=16), x, kernel, b)
  plain = jax.grad(loss, argnums=(1, 2, 3))(IdentityNoiser(), x, kernel, b)
  for got, want in zip(jax.tree.leaves(fixed), jax.tree.leaves(plain)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(FixedOrderGradNoiser().dense(x, kernel, b, name="k"),
                                IdentityNoiser().dense(x, kernel, b, name="k"))


def test_encode_weights_assistant_tokens_one_and_the_rest_observation_weight(tmp_path):
  tok = tiny_tokenizer(str(tmp_path / "tok"))
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task"},
              {"role": "assistant", "content": "ls"}, {"role": "user", "content": "a.txt"},
              {"role": "assistant", "content": "done"}]
  ids, assistant = chat.transcript_ids(tok, messages)
  tokens, plain = warmstart.encode(tok, [messages], len(ids) + 3)
  _, weighted = warmstart.encode(tok, [messages], len(ids) + 3, observation_weight=0.25)
  assert tokens[0, :len(ids)].tolist() == ids and tokens[0, len(ids):].tolist() == [0, 0, 0]
  # position i predicts token i + 1; nothing past the transcript's last token is predicted
  want = [1.0 if a else 0.25 for a in assistant[1:]] + [0.0] * 4
  np.testing.assert_array_equal(weighted[0], np.asarray(want, np.float32))
  np.testing.assert_array_equal(plain[0], np.where(np.asarray(want) == 1.0, 1.0, 0.0))
  assert 0 < plain[0].sum() < weighted[0].sum()

"""``jaxes.rollout.sampling``: a batch of greedy rows skips the nucleus (its vocabulary sort) and
returns what the nucleus path returns for greedy rows."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxes.rollout import sampling


def test_an_all_greedy_batch_returns_the_greedy_rows_of_a_sampled_batch():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 97)), jnp.float32)
  keys = sampling.row_keys(jax.random.key(0), jnp.arange(4, dtype=jnp.uint32),
                           jnp.zeros(4, jnp.int32))
  top_p = jnp.full(4, 0.9)
  fn = jax.jit(sampling.sample_with_logprob)
  greedy_tokens, greedy_logprobs = fn(logits, keys, jnp.zeros(4), top_p)
  # One sampled row sends the batch down the nucleus path; its greedy rows must agree.
  mixed_tokens, mixed_logprobs = fn(logits, keys, jnp.array([0.0, 0.0, 0.0, 0.8]), top_p)
  np.testing.assert_array_equal(greedy_tokens, np.argmax(logits, axis=-1))
  np.testing.assert_array_equal(greedy_tokens[:3], mixed_tokens[:3])
  np.testing.assert_array_equal(greedy_logprobs, np.zeros(4, np.float32))
  np.testing.assert_array_equal(mixed_logprobs[:3], np.zeros(3, np.float32))
  assert mixed_logprobs[3] < 0   # the sampled row's log-prob under its nucleus

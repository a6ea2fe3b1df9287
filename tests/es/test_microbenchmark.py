"""EGGROLL's microbenchmark through the noiser, at a toy layer: both timings, their ratio, the
reported figure, and the layer per platform."""
import jax.numpy as jnp

from jaxes.es import microbenchmark


def test_a_toy_layer_gives_both_timings_and_their_ratio():
  result = microbenchmark.eggroll((8, 32, 16), jnp.float32, repeats=2)
  assert result["shape"] == [8, 32, 16] and result["dtype"] == "float32"
  assert result["plain_s"] > 0 and result["es_s"] > 0
  assert result["es_over_plain"] == result["plain_s"] / result["es_s"]
  assert result["reported"] == microbenchmark.EGGROLL_REPORTED == 0.91


def test_the_layer_is_eggrolls_on_an_accelerator_and_smaller_on_cpu():
  assert microbenchmark.eggroll_shape("gpu") == microbenchmark.eggroll_shape("tpu") == (1024, 8192, 8192)
  assert microbenchmark.eggroll_shape("cpu") == (64, 512, 512)

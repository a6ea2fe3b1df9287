"""Next-token sampling per batch row: greedy, temperature, nucleus (top-p)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(base_key: jax.Array, streams: jax.Array, counters: jax.Array) -> jax.Array:
  """One key per row from (stream id, token counter): a row's samples do not depend on which
  other rows share its batch, so an episode's tokens are reproducible under any scheduling."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(base_key, s), c))(streams, counters)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits float32 [B, V]; keys [B]; temperature, top_p float32 [B] (temperature 0 = greedy).
  Returns int32 [B]."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  # Nucleus: keep the smallest set of most likely tokens whose mass reaches top_p (at least one).
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = mass_before < top_p[:, None]
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
  masked = jnp.where(keep, scaled, -jnp.inf)
  drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)

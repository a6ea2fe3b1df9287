"""The perturbation hook every parameterised op of the model goes through.

The model never adds noise itself: each op that reads a parameter calls one method of a
``Noiser`` with the activations, the parameter as stored, and the parameter's *name*. With
``IdentityNoiser`` the model is plain inference. ES noisers (``jaxes.es.noiser``) perturb the
op in-graph, per batch row, from keys — no perturbed copy of a weight need exist.

Names. ``name`` is the parameter's path in the model's pure state dict joined by "/", e.g.
``"layers/attn/q_proj/kernel"`` or ``"embed/embedding"``. The ES update regenerates noise for a
parameter leaf from the same path, so the op and the update agree on which noise belongs to it.

Layers. Parameters of the decoder layers are stacked with a leading layer axis and the layers
run under ``jax.lax.scan``; the op receives one layer's slice and ``layer`` (a traced int32
scalar) so the noiser can fold the layer index into the key. Unstacked parameters get
``layer=None``.

Rows. A noiser is a pytree passed into the jitted forward; it may carry per-row data (which
population member each batch row belongs to). Batch rows are the leading axis of ``x``/``ids``.

Every method returns activations in ``x``'s dtype; parameters arrive in their storage dtype.
"""
from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp


class Noiser(Protocol):
  def dense(self, x: jax.Array, kernel: jax.Array, bias: jax.Array | None, *, name: str,
            layer: jax.Array | None = None, bias_name: str | None = None) -> jax.Array:
    """``x[..., in] @ kernel[in, out] (+ bias[out])``."""

  def embed(self, table: jax.Array, ids: jax.Array, *, name: str) -> jax.Array:
    """``table[vocab, d][ids]`` -> ``[..., d]`` in the compute dtype of the caller."""

  def attend(self, x: jax.Array, table: jax.Array, *, name: str) -> jax.Array:
    """Tied LM head: ``x[..., d] @ table[vocab, d].T``, perturbed exactly as ``embed`` is."""

  def scale(self, x: jax.Array, scale: jax.Array, *, name: str,
            layer: jax.Array | None = None) -> jax.Array:
    """Elementwise ``x * scale`` (RMSNorm gain)."""


class IdentityNoiser:
  """No perturbation: the model is plain inference."""

  def dense(self, x, kernel, bias, *, name, layer=None, bias_name=None):
    del name, layer, bias_name
    y = jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))
    return y if bias is None else y + bias.astype(x.dtype)

  def embed(self, table, ids, *, name):
    del name
    return jnp.take(table, ids, axis=0)

  def attend(self, x, table, *, name):
    del name
    return jnp.einsum("...d,vd->...v", x, table.astype(x.dtype))

  def scale(self, x, scale, *, name, layer=None):
    del name, layer
    return x * scale.astype(x.dtype)


jax.tree_util.register_pytree_node(IdentityNoiser, lambda n: ((), None), lambda _, __: IdentityNoiser())


class FixedOrderGradNoiser(IdentityNoiser):
  """``IdentityNoiser`` whose dense-kernel gradients sum over positions ``chunk`` at a time, in a
  fixed order. Why: on XLA:CPU, a kernel gradient contracts over every position of the batch into
  a small ``[in, out]`` output (the attention projections), and such a contraction is split over
  the intra-op threads, whose number follows the process's CPU device count: the same program
  then gives other low bits under 1, 4 or 8 devices per process, and a 2-process rehearsal
  cannot match its 1-process run. A contraction over 64 positions is not split (measured: the
  same bits under 1 and 8 devices); the chunks add up in a scan."""

  def __init__(self, chunk: int = 64):
    self.chunk = chunk

  def dense(self, x, kernel, bias, *, name, layer=None, bias_name=None):
    del name, layer, bias_name
    y = _chunked_grad_matmul(x, kernel.astype(x.dtype), self.chunk)
    return y if bias is None else y + bias.astype(x.dtype)


jax.tree_util.register_pytree_node(FixedOrderGradNoiser, lambda n: ((), n.chunk),
                                   lambda chunk, _: FixedOrderGradNoiser(chunk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _chunked_grad_matmul(x, kernel, chunk):
  return jnp.einsum("...i,io->...o", x, kernel)


def _chunked_grad_matmul_fwd(x, kernel, chunk):
  return _chunked_grad_matmul(x, kernel, chunk), (x, kernel)


def _chunked_grad_matmul_bwd(chunk, saved, g):
  x, kernel = saved
  dx = jnp.einsum("...o,io->...i", g, kernel)
  rows_x, rows_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
  pad = -rows_x.shape[0] % chunk
  rows_x = jnp.pad(rows_x, ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[-1])
  rows_g = jnp.pad(rows_g, ((0, pad), (0, 0))).reshape(-1, chunk, g.shape[-1])

  def add(total, rows):
    return total + jnp.einsum("ti,to->io", *rows, preferred_element_type=jnp.float32), None

  dkernel, _ = jax.lax.scan(add, jnp.zeros(kernel.shape, jnp.float32), (rows_x, rows_g))
  return dx, dkernel.astype(kernel.dtype)


_chunked_grad_matmul.defvjp(_chunked_grad_matmul_fwd, _chunked_grad_matmul_bwd)

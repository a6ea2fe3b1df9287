"""Qwen2 / Qwen2.5 decoder-only language model in flax.nnx, and the Llama family (SmolLM2).

Architecture (as transformers' ``Qwen2ForCausalLM``): token embedding; ``num_layers`` pre-norm
decoder layers, each RMSNorm -> grouped-query attention (q/k/v with bias, o without, RoPE in the
``rotate_half`` layout) -> residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head
tied to the embedding or separate. ``LlamaForCausalLM`` is the same network with q/k/v/o biases
only where ``attention_bias`` (``Qwen2Config.architecture`` says which one a config is).

The decoder layers' parameters are stacked with a leading layer axis and run under
``jax.lax.scan``, so compile time does not grow with depth. Every op that reads a parameter goes
through a ``Noiser`` (``jaxes/models/noiser.py``); with the default ``IdentityNoiser`` this is plain
inference. Every parameter carries ``logical_axes`` metadata (MaxText-style names) that
``jaxes.sharding`` maps onto a device mesh (``jaxes.models.partition``). Attention kernels are in
``jaxes.models.attention``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxes.errors import OptionError
from jaxes.models import attention, hf_config
from jaxes.models.noiser import IdentityNoiser, Noiser

DTYPES = ("float32", "bfloat16")

# Published shapes (config.json of the Qwen2.5 checkpoints) plus tiny ones for CPU tests/demos.
PRESETS: dict[str, dict[str, Any]] = {
  "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768),
  "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                       num_heads=12, num_kv_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768),
  "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                     num_heads=28, num_kv_heads=4, tie_word_embeddings=False,
                     max_position_embeddings=32768),
  "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
                      num_heads=40, num_kv_heads=8, tie_word_embeddings=False,
                      max_position_embeddings=32768),
  "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
               num_kv_heads=4, tie_word_embeddings=True, max_position_embeddings=4096),
  "tiny-gqa": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2,
                   num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                   max_position_embeddings=4096),
}


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None  # as configured; None means hidden_size // num_heads (head_size)
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 32768
  param_dtype: str = "float32"  # storage dtype of the parameters
  dtype: str = "float32"  # compute dtype of activations (softmax and norms run in float32)
  # transformers' class this configuration is (what an export writes back), and whether q/k/v
  # have biases: always for Qwen2; false (no bias parameters at all) for most Llama models.
  architecture: str = "Qwen2ForCausalLM"
  attention_bias: bool = True

  def __post_init__(self):
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "max_position_embeddings"):
      value = getattr(self, key)
      if not isinstance(value, int) or value <= 0:
        raise OptionError(key, f"must be a positive int, got {value!r}", f"Qwen2Config.{key} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise OptionError("num_heads", f"{self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
                        f"Qwen2Config: num_heads={self.num_heads} is not a multiple of "
                        f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise OptionError("hidden_size", f"{self.hidden_size} is not divisible by num_heads={self.num_heads}",
                        f"Qwen2Config: hidden_size={self.hidden_size} is not divisible by "
                        f"num_heads={self.num_heads}; set head_dim explicitly")
    if self.head_size % 2 or self.head_size <= 0:
      raise ValueError(f"Qwen2Config: the head size must be even and positive for RoPE, "
                       f"got {self.head_size}")
    for key in ("param_dtype", "dtype"):
      if getattr(self, key) not in DTYPES:
        raise OptionError(key, f"must be one of {DTYPES}, got {getattr(self, key)!r}",
                          f"Qwen2Config.{key} must be one of {DTYPES}, got {getattr(self, key)!r}")
    if self.architecture not in hf_config.ARCHITECTURES:
      raise OptionError("architecture", f"must be one of {sorted(hf_config.ARCHITECTURES)}, got {self.architecture!r}",
                        f"Qwen2Config.architecture must be one of {sorted(hf_config.ARCHITECTURES)}, "
                       f"got {self.architecture!r}")
    fixed = hf_config.ARCHITECTURES[self.architecture].attention_bias
    if fixed is not None and self.attention_bias != fixed:
      raise OptionError("attention_bias", f"must be {fixed} for {self.architecture}",
                        f"Qwen2Config.attention_bias must be {fixed} for {self.architecture}")

  @property
  def head_size(self) -> int:
    """Per-head dimension: ``head_dim``, or ``hidden_size // num_heads`` when that is None. Kept
    apart from the field so ``dataclasses.replace(cfg, hidden_size=...)`` re-derives it."""
    return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

  @property
  def biased_projections(self) -> tuple[str, ...]:
    """The attention projections (``q_proj`` ...) that have a bias parameter."""
    return hf_config.ARCHITECTURES[self.architecture].biased if self.attention_bias else ()

  @property
  def num_groups(self) -> int:
    """Query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @classmethod
  def preset(cls, name: str, **overrides) -> "Qwen2Config":
    if name not in PRESETS:
      raise ValueError(f"unknown Qwen2 preset {name!r}; known: {sorted(PRESETS)}")
    return cls(**{**PRESETS[name], **overrides})

  @classmethod
  def from_hf_dict(cls, d: dict, **overrides) -> "Qwen2Config":
    """From a transformers ``config.json`` dict; unsupported features raise naming the key."""
    return cls(**{**hf_config.config_kwargs_from_hf(d), **overrides})

  def to_hf_dict(self) -> dict:
    """A transformers ``config.json`` dict for this configuration."""
    return hf_config.hf_dict_from_config(self)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "index", "valid"],
                   meta_fields=["dtype"])
@dataclasses.dataclass
class KVCache:
  """Per-row key/value cache. Rows fill independently, so they may sit at different positions.

  k, v: [L, B, S, KVH, hd] keys (after RoPE) and values, stored as the raw bits of ``dtype``
  (unsigned ints of its width; ``keys()`` / ``values()`` read them as ``dtype``): a backend
  without native bfloat16 (the CPU) would otherwise scatter into and read from float32 copies
  of the whole cache. index: [B] int32, the next free slot of each row; valid: [B, S] bool,
  which slots hold a token. Writes beyond S are dropped: the caller sizes S for the longest row.
  """
  k: jax.Array
  v: jax.Array
  index: jax.Array
  valid: jax.Array
  dtype: str = "float32"

  LOGICAL_AXES = dict(k=("layers", "cache_batch", "cache_seq", "kv_heads", "head_dim"),
                      v=("layers", "cache_batch", "cache_seq", "kv_heads", "head_dim"),
                      index=("cache_batch",), valid=("cache_batch", "cache_seq"))

  @classmethod
  def init(cls, cfg: Qwen2Config, batch_size: int, max_len: int, dtype: str | None = None):
    shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_size)
    dtype = jnp.dtype(dtype or cfg.dtype)
    bits = jnp.dtype(f"uint{8 * dtype.itemsize}")  # zero bits are 0.0
    return cls(k=jnp.zeros(shape, bits), v=jnp.zeros(shape, bits),
               index=jnp.zeros((batch_size,), jnp.int32),
               valid=jnp.zeros((batch_size, max_len), bool), dtype=dtype.name)

  def keys(self) -> jax.Array:
    return jax.lax.bitcast_convert_type(self.k, jnp.dtype(self.dtype))

  def values(self) -> jax.Array:
    return jax.lax.bitcast_convert_type(self.v, jnp.dtype(self.dtype))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "index", "valid", "table"], meta_fields=["dtype"])
@dataclasses.dataclass
class PagedKVCache:
  """A ``KVCache`` whose keys and values live in fixed-size pages: ``k, v [L, P, page, KVH, hd]``
  (raw bits of ``dtype``, as ``KVCache``), and ``table [B, S // page]`` int32 says which page
  holds slots ``j * page ...`` of row b. The pages are split over the ``data`` shards with the
  rows (rows and pages both ``cache_batch``), and a row's page ids are local to its shard (page
  ``table[b, j]`` of the shard that holds row b): every access runs per shard
  (``attention.Pages``). ``index [B]`` and ``valid [B, S]`` are per row as in ``KVCache``; a
  table entry whose slots are not valid may name any page. The host owns the table
  (``jaxes.rollout.pages``) and replaces it when it changes. ``init(interleaved=True)``: the
  layout TPU's ``ragged_paged_attention`` reads, keys and values interleaved over the heads of
  ``k [L, P, page, 2 * KVH, hd]`` and ``v`` an empty ``[L, P, page, 0, hd]``
  (``attention.interleaved``), holding values of ``dtype``, not raw bits (the kernel reads the
  whole array, and the TPU compiler makes a bitcast of it a copy)."""
  k: jax.Array
  v: jax.Array
  index: jax.Array
  valid: jax.Array
  table: jax.Array
  dtype: str = "float32"

  LOGICAL_AXES = dict(k=("layers", "cache_batch", "cache_seq", "kv_heads", "head_dim"),
                      v=("layers", "cache_batch", "cache_seq", "kv_heads", "head_dim"),
                      index=("cache_batch",), valid=("cache_batch", "cache_seq"),
                      table=("cache_batch", "cache_seq"))

  @classmethod
  def init(cls, cfg: Qwen2Config, batch_size: int, max_len: int, page_size: int, num_pages: int,
           dtype: str | None = None, interleaved: bool = False):
    if max_len % page_size:
      raise ValueError(f"max_len={max_len} is not a multiple of page_size={page_size}")
    heads = cfg.num_kv_heads
    k_heads, v_heads = (2 * heads, 0) if interleaved else (heads, heads)
    pages = (cfg.num_layers, num_pages, page_size)
    dtype = jnp.dtype(dtype or cfg.dtype)
    held = dtype if interleaved else jnp.dtype(f"uint{8 * dtype.itemsize}")
    return cls(k=jnp.zeros(pages + (k_heads, cfg.head_size), held),
               v=jnp.zeros(pages + (v_heads, cfg.head_size), held),
               index=jnp.zeros((batch_size,), jnp.int32),
               valid=jnp.zeros((batch_size, max_len), bool),
               table=jnp.zeros((batch_size, max_len // page_size), jnp.int32), dtype=dtype.name)

  @property
  def page_size(self) -> int:
    return self.k.shape[2]


def cache_bytes_per_token(cache: KVCache | PagedKVCache) -> int:
  """Bytes one token's keys and values take in ``cache`` (arrays or shapes), over all layers:
  the same for the split and the interleaved layouts (there ``v`` is empty and ``k`` holds both)."""
  k, v = cache.k, cache.v
  heads = math.prod(k.shape[3:]) + math.prod(v.shape[3:])
  return jnp.dtype(k.dtype).itemsize * k.shape[0] * heads


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logits_at", "access", "token_offsets"],
                   meta_fields=["attend_len", "bounded_keys", "head", "remat"])
@dataclasses.dataclass(frozen=True)
class Options:
  """A forward's optional inputs (``Qwen2ForCausalLM.__call__``), a pytree whose static fields
  are static under ``jax.jit``.

  ``logits_at`` (int32 [B]): the logits of one position per row only, [B, V]: a sampler needs
  no more, and the LM head is a large part of a wide prefill chunk's cost. ``head=False``
  (static): the final-normed hidden states [B, T, d] in place of the logits, for a caller that
  applies the LM head (``lm_logits``) to a few positions at a time. ``remat`` (static; without
  a cache): each layer under ``jax.checkpoint``, so a gradient holds one layer's activations at
  a time (plus every layer's input) and recomputes the rest in the backward.

  With a cache: ``access`` (``attention.CacheAccess``; None: ``attention.Dense``, batch row b
  is cache row b): how the batch reaches the cache: ``attention.Rows``, some rows of a larger
  (sharded) cache read and written in place, the other rows untouched; ``attention.Pages``
  for a ``PagedKVCache``, the batch rows' page tables (with ``rows``: those rows).
  ``attend_len`` (static) bounds attention to the cache's first slots when every row's tokens,
  these included, fit in them: attention over the whole cache otherwise dominates the cost of a
  step while rows are short. ``token_offsets`` (int32 [B, T], with ``access`` naming rows; a
  ragged token batch): batch rows may share a cache row, token t of batch row i going to slot
  ``index + token_offsets[i, t]`` of its row and seeing every slot of that row this call writes
  up to its own; attention reads key blocks up to each device's furthest token only (one
  program for every attention length). ``bounded_keys`` (static): that bound for an ordinary
  batch too (invalid tokens query slot 0), so one ``attend_len`` serves every length."""
  logits_at: jax.Array | None = None
  access: Any = None
  token_offsets: jax.Array | None = None
  attend_len: int | None = None
  bounded_keys: bool = False
  head: bool = True
  remat: bool = False


def _stack(layers: int, shape: tuple, axes: tuple) -> tuple[tuple, tuple]:
  """Prefix a leading layer axis when the parameter belongs to the scanned decoder layers."""
  return ((layers, *shape), ("layers", *axes)) if layers else (shape, axes)


class Linear(nnx.Module):
  """``x @ kernel[in, out] (+ bias[out])`` through the noiser."""

  def __init__(self, path: str, din: int, dout: int, axes: tuple[str, str], *, bias: bool,
               layers: int, cfg: Qwen2Config, rngs: nnx.Rngs):
    self.path = path
    dtype = jnp.dtype(cfg.param_dtype)
    shape, kernel_axes = _stack(layers, (din, dout), axes)
    self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape, dtype),
                            logical_axes=kernel_axes)
    if bias:
      shape, bias_axes = _stack(layers, (dout,), axes[1:])
      self.bias = nnx.Param(jnp.zeros(shape, dtype), logical_axes=bias_axes)
    else:
      self.bias = None

  def __call__(self, x: jax.Array, noiser: Noiser, layer: jax.Array | None = None) -> jax.Array:
    bias = None if self.bias is None else self.bias[...]
    return noiser.dense(x, self.kernel[...], bias, name=f"{self.path}/kernel", layer=layer,
                        bias_name=None if bias is None else f"{self.path}/bias")


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale``; the normalisation runs in float32 as in transformers."""

  def __init__(self, path: str, dim: int, *, layers: int, cfg: Qwen2Config):
    self.path = path
    self.eps = cfg.rms_norm_eps
    shape, axes = _stack(layers, (dim,), ("norm",))
    self.scale = nnx.Param(jnp.ones(shape, jnp.dtype(cfg.param_dtype)), logical_axes=axes)

  def __call__(self, x: jax.Array, noiser: Noiser, layer: jax.Array | None = None) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return noiser.scale(normed.astype(x.dtype), self.scale[...], name=f"{self.path}/scale",
                        layer=layer)


class Embed(nnx.Module):
  def __init__(self, path: str, cfg: Qwen2Config, rngs: nnx.Rngs):
    self.path = path
    self.embedding = nnx.Param(
      nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                    jnp.dtype(cfg.param_dtype)),
      logical_axes=("vocab", "embed"))

  def __call__(self, ids: jax.Array, noiser: Noiser) -> jax.Array:
    return noiser.embed(self.embedding[...], ids, name=f"{self.path}/embedding")

  def attend(self, x: jax.Array, noiser: Noiser) -> jax.Array:
    return noiser.attend(x, self.embedding[...], name=f"{self.path}/embedding")


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in transformers' ``rotate_half`` layout. x: [B, T, N, hd]; positions [B, T]."""
  head_dim = x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query attention; KV heads are shared by their query group, never repeated."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, q_dim, kv_dim, L = (cfg.hidden_size, cfg.num_heads * cfg.head_size,
                           cfg.num_kv_heads * cfg.head_size, cfg.num_layers)
    common = dict(layers=L, cfg=cfg, rngs=rngs)
    biased = cfg.biased_projections
    self.q_proj = Linear("layers/attn/q_proj", d, q_dim, ("embed", "heads"),
                         bias="q_proj" in biased, **common)
    self.k_proj = Linear("layers/attn/k_proj", d, kv_dim, ("embed", "kv_heads"),
                         bias="k_proj" in biased, **common)
    self.v_proj = Linear("layers/attn/v_proj", d, kv_dim, ("embed", "kv_heads"),
                         bias="v_proj" in biased, **common)
    self.o_proj = Linear("layers/attn/o_proj", q_dim, d, ("heads", "embed"),
                         bias="o_proj" in biased, **common)

  def __call__(self, x, positions, noiser, layer, mask=None, cache=None):
    """x: [B, T, d]. Without a cache, ``mask`` [B, T] says which tokens are real; query t sees
    the real ones up to t (``attention.attend_sequence``). With one (``attention.LayerCache``),
    this layer's keys and values are written into it and the queries attend to it. Returns
    (output, the cache written, or None)."""
    cfg = self.cfg
    B, T, _ = x.shape
    q = self.q_proj(x, noiser, layer).reshape(B, T, cfg.num_heads, cfg.head_size)
    k = self.k_proj(x, noiser, layer).reshape(B, T, cfg.num_kv_heads, cfg.head_size)
    v = self.v_proj(x, noiser, layer).reshape(B, T, cfg.num_kv_heads, cfg.head_size)
    q = apply_rope(q, positions, cfg.rope_theta)
    k = apply_rope(k, positions, cfg.rope_theta)
    q = q.reshape(B, T, cfg.num_kv_heads, cfg.num_groups, cfg.head_size)
    if cache is None:
      out = attention.attend_sequence(q, k, v, mask)
    else:
      cache = cache.write(layer, k, v)
      out = cache.attend(q, layer)
    return self.o_proj(out.reshape(B, T, -1), noiser, layer), cache


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``, no biases."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    common = dict(bias=False, layers=cfg.num_layers, cfg=cfg, rngs=rngs)
    self.gate_proj = Linear("layers/mlp/gate_proj", d, f, ("embed", "mlp"), **common)
    self.up_proj = Linear("layers/mlp/up_proj", d, f, ("embed", "mlp"), **common)
    self.down_proj = Linear("layers/mlp/down_proj", f, d, ("mlp", "embed"), **common)

  def __call__(self, x, noiser, layer):
    gate = jax.nn.silu(self.gate_proj(x, noiser, layer))
    return self.down_proj(gate * self.up_proj(x, noiser, layer), noiser, layer)


class DecoderLayer(nnx.Module):
  """One pre-norm decoder layer; its parameters are stacked over all layers [L, ...]."""

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    L = cfg.num_layers
    self.input_norm = RMSNorm("layers/input_norm", cfg.hidden_size, layers=L, cfg=cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.post_attn_norm = RMSNorm("layers/post_attn_norm", cfg.hidden_size, layers=L, cfg=cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, noiser, layer, mask=None, cache=None):
    h, cache = self.attn(self.input_norm(x, noiser, layer), positions, noiser, layer, mask, cache)
    x = x + h
    x = x + self.mlp(self.post_attn_norm(x, noiser, layer), noiser, layer)
    return x, cache


class Qwen2ForCausalLM(nnx.Module):

  def __init__(self, cfg: Qwen2Config, *, rngs: nnx.Rngs):
    self.config = cfg
    self.embed = Embed("embed", cfg, rngs)
    self.layers = DecoderLayer(cfg, rngs=rngs)
    self.final_norm = RMSNorm("final_norm", cfg.hidden_size, layers=0, cfg=cfg)
    if cfg.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Linear("lm_head", cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"),
                            bias=False, layers=0, cfg=cfg, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
               cache: KVCache | PagedKVCache | None = None, noiser: Noiser | None = None,
               options: Options = Options()) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
    """tokens, positions: int32 [B, T]; valid: bool [B, T]. Returns (float32 logits [B, T, V],
    updated cache). See ``KVCache`` for the cache semantics and ``Options`` for the rest."""
    cfg = self.config
    noiser = IdentityNoiser() if noiser is None else noiser
    valid = valid.astype(bool)
    x = self.embed(tokens, noiser).astype(jnp.dtype(cfg.dtype))

    layers_def, layers_state = nnx.split(self.layers)
    layer_ids = jnp.arange(cfg.num_layers)
    if cache is None:
      def one_layer(x, scanned):
        state, layer = scanned
        x, _ = nnx.merge(layers_def, state)(x, positions, noiser, layer, mask=valid)
        return x, None

      if options.remat:  # the backward keeps each layer's input only and recomputes the rest
        one_layer = jax.checkpoint(one_layer, prevent_cse=False)
      x, _ = jax.lax.scan(one_layer, x, (layers_state, layer_ids))
    else:
      access = attention.Dense() if options.access is None else options.access
      layer_cache = self._layer_cache(cache, access, valid, options)

      # The cache's buffers ride in the scan's carry and each layer writes its new keys into
      # them: a cache passed as scanned input/output would be rebuilt as a second full copy.
      def one_layer(carry, scanned):
        x, k, v = carry
        state, layer = scanned
        x, written = nnx.merge(layers_def, state)(
            x, positions, noiser, layer, cache=dataclasses.replace(layer_cache, k=k, v=v))
        return (x, written.k, written.v), None

      (x, cache_k, cache_v), _ = jax.lax.scan(one_layer, (x, cache.k, cache.v),
                                              (layers_state, layer_ids))
      cache = dataclasses.replace(
          cache, k=cache_k, v=cache_v,
          index=access.advance(cache.index, valid.sum(axis=1, dtype=jnp.int32)),
          valid=access.mark(cache.valid, layer_cache.addressing.write_slots))
    if options.logits_at is not None:
      x = x[jnp.arange(x.shape[0]), options.logits_at]
    x = self.final_norm(x, noiser)
    out = self.lm_logits(x, noiser) if options.head else x
    return out, cache

  @staticmethod
  def _layer_cache(cache: KVCache | PagedKVCache, access: attention.CacheAccess,
                   valid: jax.Array, options: Options) -> attention.LayerCache:
    """What every layer of this call reads and writes: each token's slot, where its keys go
    and which slots each batch row sees (its cache row's valid slots and this call's), as one
    ``attention.Addressing``, with the implementation that reads the cache."""
    S = cache.valid.shape[1]
    row_index, row_valid = access.take(cache.index), access.take(cache.valid)
    offsets = options.token_offsets
    if offsets is None:
      slots = row_index[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
      write_slots = jnp.where(valid, slots, S)
      if options.bounded_keys:   # invalid tokens (their outputs unused) must not extend the key blocks
        slots = jnp.where(valid, slots, 0)
      rows = jnp.arange(valid.shape[0])[:, None]
      cache_valid = row_valid.at[rows, write_slots].set(True, mode="drop")
    else:
      if not access.names_rows:
        raise ValueError("Options.token_offsets needs Options.access naming each batch row's cache "
                         "row (attention.Rows, or attention.Pages with rows): a ragged batch names "
                         "its tokens' rows")
      # Padding tokens query slot 0, so they never extend the key blocks a device reads.
      slots = jnp.where(valid, row_index[:, None] + offsets, 0)
      write_slots = jnp.where(valid, slots, S)
      # A row's slots from its index on are this call's tokens (of any batch row), each written
      # before attention reads it; ``s <= q_slot`` keeps the later ones out of view.
      cache_valid = row_valid | (jnp.arange(S)[None, :] >= row_index[:, None])
    span = S if options.attend_len is None else min(options.attend_len, S)
    addressing = attention.Addressing(cache_valid, slots, span, write_slots,
                                      bounded=offsets is not None or options.bounded_keys)
    return attention.layer_cache(cache.k, cache.v, access, addressing, jnp.dtype(cache.dtype))

  def lm_logits(self, x: jax.Array, noiser: Noiser | None = None) -> jax.Array:
    """float32 logits [..., V] of final-normed hidden states [..., d]: the LM head."""
    noiser = IdentityNoiser() if noiser is None else noiser
    logits = self.embed.attend(x, noiser) if self.lm_head is None else self.lm_head(x, noiser)
    return logits.astype(jnp.float32)


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, positions: jax.Array,
            valid: jax.Array, cache: KVCache | PagedKVCache | None = None,
            noiser: Noiser | None = None, options: Options = Options()):
  """Pure functional forward for use inside ``jax.jit``: ``nnx.merge`` then call."""
  return nnx.merge(graphdef, params)(tokens, positions, valid, cache, noiser, options)

"""transformers ``config.json`` <-> ``Qwen2Config``: what we support, and a clear error otherwise.

Two architectures share the model (``jaxes.models.qwen2``): Qwen2 (q/k/v biases always) and the
Llama family (biases only with ``attention_bias``; SmolLM2 has none). Both use the ``rotate_half``
RoPE layout, SwiGLU and RMSNorm, so they differ in the biases alone.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class Architecture(NamedTuple):
  model_type: str
  attention_bias: bool | None   # fixed for the architecture, or None: config.json's attention_bias
  biased: tuple[str, ...]       # the attention projections a bias comes with


# transformers' architectures: Qwen2's q/k/v always have biases (o never); Llama's q/k/v/o have
# them only where config.json says ``attention_bias``.
ARCHITECTURES = {
  "Qwen2ForCausalLM": Architecture("qwen2", True, ("q_proj", "k_proj", "v_proj")),
  "LlamaForCausalLM": Architecture("llama", None, ("q_proj", "k_proj", "v_proj", "o_proj")),
}
MODEL_TYPES = {a.model_type: name for name, a in ARCHITECTURES.items()}


class UnsupportedConfigError(ValueError):
  """A config.json key or value this implementation does not support."""


def _require(d: dict, key: str) -> Any:
  if key not in d or d[key] is None:
    raise UnsupportedConfigError(f"config.json: required key {key!r} is missing")
  return d[key]


def _rope_theta(d: dict) -> float:
  """Newer transformers store θ under ``rope_parameters``; older ones at the top level."""
  rope = d.get("rope_parameters")
  if rope is None:
    rope = d.get("rope_scaling")
    if rope is not None and rope.get("rope_type", rope.get("type", "default")) != "default":
      raise UnsupportedConfigError(
        f"config.json: rope_scaling={rope!r} is not supported (only default RoPE)")
    return float(d.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", "default")
  if rope_type != "default":
    raise UnsupportedConfigError(
      f"config.json: rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
  return float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))


def architecture_of(d: dict) -> str:
  """The architecture a config.json describes; ``architectures`` and ``model_type`` must agree."""
  archs = d.get("architectures")
  model_type = d.get("model_type")
  if archs:
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
      raise UnsupportedConfigError(
        f"config.json: architectures={archs!r}; only {sorted(ARCHITECTURES)} are supported")
    arch = known[0]
  elif model_type is None:
    return "Qwen2ForCausalLM"   # neither key: a Qwen2 config, as jaxes always read it
  elif model_type in MODEL_TYPES:
    arch = MODEL_TYPES[model_type]
  else:
    raise UnsupportedConfigError(
      f"config.json: model_type={model_type!r}; only {sorted(MODEL_TYPES)} are supported")
  if model_type is not None and model_type != ARCHITECTURES[arch].model_type:
    raise UnsupportedConfigError(
      f"config.json: architectures={archs!r} but model_type={model_type!r}; "
      f"{arch} has model_type {ARCHITECTURES[arch].model_type!r}")
  return arch


def _attention_bias(d: dict, arch: str) -> bool:
  fixed = ARCHITECTURES[arch].attention_bias
  if fixed is not None:
    if d.get("attention_bias", fixed) != fixed:
      raise UnsupportedConfigError(
        f"config.json: attention_bias={d['attention_bias']!r}; {arch} always has attention_bias={fixed}")
    return fixed
  return bool(d.get("attention_bias", False))


def config_kwargs_from_hf(d: dict) -> dict:
  arch = architecture_of(d)
  if d.get("mlp_bias"):
    raise UnsupportedConfigError("config.json: mlp_bias=true is not supported")
  if d.get("use_sliding_window"):
    raise UnsupportedConfigError("config.json: use_sliding_window=true is not supported")
  layer_types = d.get("layer_types")
  if layer_types and any(t != "full_attention" for t in layer_types):
    raise UnsupportedConfigError(
      f"config.json: layer_types contains {sorted(set(layer_types) - {'full_attention'})}; "
      "only full attention is supported")
  if d.get("hidden_act", "silu") != "silu":
    raise UnsupportedConfigError(
      f"config.json: hidden_act={d['hidden_act']!r}; only 'silu' is supported")
  heads = int(_require(d, "num_attention_heads"))
  return dict(
    vocab_size=int(_require(d, "vocab_size")),
    hidden_size=int(_require(d, "hidden_size")),
    intermediate_size=int(_require(d, "intermediate_size")),
    num_layers=int(_require(d, "num_hidden_layers")),
    num_heads=heads,
    num_kv_heads=int(d.get("num_key_value_heads") or heads),
    head_dim=d.get("head_dim"),
    rope_theta=_rope_theta(d),
    rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
    tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
    architecture=arch,
    attention_bias=_attention_bias(d, arch),
  )


def hf_dict_from_config(cfg) -> dict:
  """``cfg``: a ``jaxes.models.qwen2.Qwen2Config`` (read by field; this module imports no model,
  so ``qwen2`` can import it at the top)."""
  d = dict(
    architectures=[cfg.architecture], model_type=ARCHITECTURES[cfg.architecture].model_type,
    hidden_act="silu",
    vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
    num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
    rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
    max_position_embeddings=cfg.max_position_embeddings,
    rope_theta=cfg.rope_theta, rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta),
    use_sliding_window=False, attention_dropout=0.0, dtype=cfg.param_dtype,
    torch_dtype=cfg.param_dtype,
  )
  if cfg.head_dim is not None:
    d["head_dim"] = cfg.head_dim
  if ARCHITECTURES[cfg.architecture].attention_bias is None:   # the key is this architecture's only
    d.update(attention_bias=cfg.attention_bias, mlp_bias=False)
  return d

"""transformers ``config.json`` <-> ``Qwen2Config``: what we support, and a clear error otherwise."""
from __future__ import annotations

from typing import Any

ARCHITECTURE = "Qwen2ForCausalLM"


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


def config_kwargs_from_hf(d: dict) -> dict:
  archs = d.get("architectures")
  if archs and ARCHITECTURE not in archs:
    raise UnsupportedConfigError(
      f"config.json: architectures={archs!r}; only {ARCHITECTURE!r} is supported")
  if d.get("model_type", "qwen2") != "qwen2":
    raise UnsupportedConfigError(
      f"config.json: model_type={d['model_type']!r}; only 'qwen2' is supported")
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
  )


def hf_dict_from_config(cfg) -> dict:
  """``cfg``: a ``jaxes.models.qwen2.Qwen2Config`` (read by field; this module imports no model,
  so ``qwen2`` can import it at the top)."""
  d = dict(
    architectures=[ARCHITECTURE], model_type="qwen2", hidden_act="silu",
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
  return d

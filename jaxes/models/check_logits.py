"""Compare jaxes' logits with transformers' (torch, CPU) on a local checkpoint.

    python -m jaxes.models.check_logits --model DIR|FILE.gguf|pip:PACKAGE [--dtype float32|bfloat16]
        [--mesh data=1,fsdp=4,tensor=2] [--prompt TEXT]

``--model`` (or ``--hf_dir``) is any model source (``jaxes.models.sources``): a transformers
checkpoint directory (Qwen2 or Llama), which transformers loads itself, or a GGUF file, which
transformers dequantizes with its own GGUF loader into its model class: an independent reading
of the file (dequantization, q/k row order, config) as well as of the network.

Prints a per-position table, then, last, one JSON line
``{"max_abs_diff": ..., "kl": ..., "top1_agreement": ...}``; exits 0 iff within tolerance
(float32: max |Δlogit| <= 1e-4), 1 when outside it, 2 when the checkpoint or mesh is unusable.
Tokens come from the checkpoint's tokenizer when it has one, else from the prompt's UTF-8 bytes
modulo the vocabulary. On a CPU-only machine a mesh of N devices gets N host CPU
devices.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

import numpy as np

# float32 must match to 1e-4 (the parity bar); bfloat16 differs by op order, so it is judged on
# the distributions instead.
TOLERANCES = {
  "float32": {"max_abs_diff": 1e-4},
  "bfloat16": {"kl": 1e-2, "top1_agreement": 0.9},
}
DEFAULT_PROMPT = "Write a shell command that counts the lines of every *.py file under src/."


def _tokens(model: str, prompt: str, vocab_size: int) -> np.ndarray:
  from jaxes.models import sources
  if sources.has_tokenizer(model):
    ids = sources.load_tokenizer(model).encode(prompt)
  else:
    ids = [b % vocab_size for b in prompt.encode()]
  if not ids:
    raise SystemExit("check_logits: the prompt encodes to no tokens")
  return np.asarray(ids, np.int64)[None]


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(reference: np.ndarray, ours: np.ndarray) -> dict:
  """Metrics over positions of [T, V] logits: max |Δ|, mean KL(reference || ours), top-1 match."""
  log_p, log_q = _log_softmax(reference), _log_softmax(ours)
  kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
  return {"max_abs_diff": float(np.abs(reference - ours).max()), "kl": float(kl.mean()),
          "top1_agreement": float((reference.argmax(-1) == ours.argmax(-1)).mean()),
          "per_position_kl": kl}


def within_tolerance(metrics: dict, dtype: str) -> bool:
  tol = TOLERANCES[dtype]
  return (metrics["max_abs_diff"] <= tol.get("max_abs_diff", math.inf)
          and metrics["kl"] <= tol.get("kl", math.inf)
          and metrics["top1_agreement"] >= tol.get("top1_agreement", 0.0))


def transformers_model(model: str, architecture: str, dtype: str):
  """transformers' own model of the source ``model`` (the reference), in ``dtype``."""
  import torch
  import transformers
  from jaxes.models import sources

  path = sources.resolve(model)
  model_class = getattr(transformers, architecture)
  if not path.endswith(".gguf"):
    return model_class.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True).eval()
  # transformers' GGUF reader (the one from_pretrained(gguf_file=...) builds on, without the
  # accelerate package that entry point asks for): config and dequantized tensors by HF name.
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  config = model_class.config_class(**load_gguf_checkpoint(path)["config"])
  reference = model_class(config)
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=reference)["tensors"]
  missing, unexpected = reference.load_state_dict(tensors, strict=False)
  if unexpected or set(missing) - {"lm_head.weight"}:   # a tied head is the embedding
    raise ValueError(f"{path}: transformers' GGUF reader gave unexpected tensors {unexpected[:3]} "
                     f"and none for {sorted(missing)[:3]}")
  if config.tie_word_embeddings:
    reference.tie_weights()
  return reference.to(getattr(torch, dtype)).eval()


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", "--hf_dir", dest="model", required=True,
                      help="a checkpoint directory, a .gguf file or pip:PACKAGE")
  parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES))
  parser.add_argument("--mesh", default=None, help="e.g. data=1,fsdp=4,tensor=2")
  parser.add_argument("--prompt", default=DEFAULT_PROMPT)
  args = parser.parse_args(argv)

  import jax
  from jaxes import sharding
  mesh_sizes = sharding.parse_mesh(args.mesh) if args.mesh else None
  if mesh_sizes and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Only takes effect on the CPU backend and before it starts; accelerators are left alone.
    jax.config.update("jax_num_cpu_devices", math.prod(mesh_sizes.values()))

  try:
    import torch
  except ImportError:
    print("check_logits: needs torch for the transformers reference (pip install -e '.[test]')",
          file=sys.stderr)
    return 2
  from jaxes.models import qwen2, sources

  mesh = sharding.make_mesh(**mesh_sizes) if mesh_sizes else None
  try:
    cfg, graphdef, params = sources.load(args.model, mesh=mesh, param_dtype=args.dtype,
                                         dtype=args.dtype)
  except ValueError as e:  # CheckpointError, UnsupportedConfigError, mesh/divisibility errors
    print(f"check_logits: {e}", file=sys.stderr)
    return 2
  tokens = _tokens(args.model, args.prompt, cfg.vocab_size)
  T = tokens.shape[1]
  # float32 parity needs true float32 matmuls; GPUs and TPUs default to reduced-precision passes.
  with jax.default_matmul_precision("float32" if args.dtype == "float32" else "default"):
    ours, _ = jax.jit(qwen2.forward, static_argnums=0)(
      graphdef, params, jax.numpy.asarray(tokens, np.int32), jax.numpy.arange(T)[None],
      jax.numpy.ones((1, T), bool))
  ours = np.asarray(ours[0], np.float32)

  torch_model = transformers_model(args.model, cfg.architecture, args.dtype)
  with torch.no_grad():
    reference = torch_model(torch.as_tensor(tokens)).logits[0].float().numpy()

  metrics = compare(reference, ours)
  devices = mesh.devices.size if mesh is not None else 1
  print(f"checkpoint {args.model}: {cfg.architecture}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, "
        f"dtype {args.dtype}, {devices} device(s) {mesh_sizes or ''}")
  print(f"{'pos':>4} {'token':>7} {'hf_top1':>8} {'jax_top1':>8} {'max|dlogit|':>12} {'kl':>10}")
  for t in range(T):
    print(f"{t:>4} {tokens[0, t]:>7} {reference[t].argmax():>8} {ours[t].argmax():>8} "
          f"{np.abs(reference[t] - ours[t]).max():>12.3e} {metrics['per_position_kl'][t]:>10.3e}")
  ok = within_tolerance(metrics, args.dtype)
  print(f"{'PASS' if ok else 'FAIL'}: tolerance {TOLERANCES[args.dtype]}")
  print(json.dumps({k: metrics[k] for k in ("max_abs_diff", "kl", "top1_agreement")}))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

"""``python -m jaxes.train.export --workdir=W [--version=V] --out=DIR``: a run's policy as a
Hugging Face directory (config.json, safetensors, tokenizer) that transformers loads as
``Qwen2ForCausalLM``; ``python -m jaxes.models.check_logits --hf_dir DIR`` checks its logits."""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from jaxes.models import hf
from jaxes.train import checkpoint
from jaxes.train.policy import PolicyLoadError, load_policy


def export(workdir: str, out: str, version: int | None = None) -> int:
  """Writes the policy of ``version`` (default: newest) to ``out``; returns the version."""
  policy = load_policy(workdir, version)
  hf.save(out, policy.model_config, policy.params)
  policy.tokenizer.save_pretrained(out)
  if policy.config_changes:   # provenance: the version was trained under config changes
    with open(os.path.join(out, "jaxes_config_history.json"), "w") as f:
      json.dump({"run": os.path.abspath(workdir), "version": policy.version,
                 "config_changes": policy.config_changes}, f, indent=2)
  return policy.version


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="the run directory")
  parser.add_argument("--version", type=int, default=None, help="a checkpointed version (default: newest)")
  parser.add_argument("--out", required=True, help="output directory")
  args = parser.parse_args(argv)
  try:
    with warnings.catch_warnings(record=True) as said:   # a skipped corrupt step: one line, below
      warnings.simplefilter("always", RuntimeWarning)
      version = export(args.workdir, args.out, args.version)
  except (PolicyLoadError, checkpoint.CheckpointError) as e:
    print(f"export: {e}", file=sys.stderr)
    sys.exit(2)
  for w in said:
    print(f"export: {w.message}", file=sys.stderr)
  print(f"exported version {version} of {args.workdir} to {args.out}")


if __name__ == "__main__":
  main()

"""``python -m jaxes.run_tools.export --workdir=W [--version=V] --out=DIR [--overwrite]``: a run's
policy as a Hugging Face directory (config.json, safetensors, tokenizer) that transformers loads
as ``Qwen2ForCausalLM`` (``LlamaForCausalLM``: a run of a Llama-family model, e.g. SmolLM2); ``python -m jaxes.models.check_logits --hf_dir DIR`` checks its logits.

``--out`` must not be inside a run directory (its config.json would replace the run's, which
could then not be resumed), and a directory that already holds files is refused unless
``--overwrite``. Errors are one line with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from jaxes import cli


def refusal(workdir: str, out: str, overwrite: bool) -> str | None:
  """Why ``out`` must not receive the export, or None."""
  out, run = os.path.realpath(out), os.path.realpath(workdir)
  inside = out == run or out.startswith(run + os.sep)
  ancestor = next((d for d in _ancestors(out) if os.path.isdir(os.path.join(d, "checkpoints"))
                   and os.path.isfile(os.path.join(d, "config.json"))), None)
  if inside or ancestor:
    return (f"--out={out} is inside the run directory {run if inside else ancestor}: its config.json "
            f"would replace the run's; export to a directory outside it")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    return f"--out={out} already holds files; pass --overwrite to replace them, or choose another --out"
  return None


def _ancestors(path: str):
  while True:
    yield path
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


def export(workdir: str, out: str, version: int | None = None) -> int:
  """Writes the policy of ``version`` (default: newest) to ``out``; returns the version."""
  from jaxes.models import hf
  from jaxes.train.policy import load_policy
  policy = load_policy(workdir, version)
  hf.save(out, policy.model_config, policy.params)
  policy.tokenizer.save_pretrained(out)
  if policy.config_changes:   # provenance: the version was trained under config changes
    with open(os.path.join(out, "jaxes_config_history.json"), "w") as f:
      json.dump({"run": os.path.abspath(workdir), "version": policy.version,
                 "config_changes": policy.config_changes}, f, indent=2)
  return policy.version


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxes.run_tools.export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the run directory")
  parser.add_argument("--version", type=int, default=None, help="a checkpointed version (default: newest)")
  parser.add_argument("--out", required=True, help="output directory (outside any run directory)")
  parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing --out")
  args = parser.parse_args(argv)
  if (why := refusal(args.workdir, args.out, args.overwrite)) is not None:
    cli.usage_error("export", why)
  cli.start_jax()   # before anything imports JAX: quiet, and on CPU where no accelerator is
  from jaxes.train import checkpoint
  from jaxes.train.policy import PolicyLoadError
  try:
    with warnings.catch_warnings(record=True) as said:   # a skipped corrupt step: one line, below
      warnings.simplefilter("always", RuntimeWarning)
      version = export(args.workdir, args.out, args.version)
  except (PolicyLoadError, checkpoint.CheckpointError) as e:
    cli.usage_error("export", str(e))
  for w in said:
    print(f"export: {w.message}", file=sys.stderr)
  print(f"exported version {version} of {args.workdir} to {args.out}")


if __name__ == "__main__":
  main()

"""``python -m jaxes.run_tools.probe RUN_DIR [RUN_DIR ...] [--versions=0,last] [--file=bundled]``:
a finished run's checkpoints scored on multiple-choice probes afterwards (``jaxes.train.mc_probe``),
for runs trained without ``eval.mc_probe_file``: what each checkpointed version still knows off
its training tasks, without retraining.

Each run directory gets ``mc_probe.json`` (version -> the probe's measures, and the file scored)
and one line per version on stdout; then, where the directories are a grid's
(``<variant>-s<seed>``), one line per variant: the mean ± s.e. over seeds of the last version's
accuracy and answer log-likelihood, and of their change from the first version. ``--versions``:
checkpointed versions, ``last`` for the newest (default ``0,last``). Errors are one line with exit
status 2; a run that cannot be read is reported and skipped (then the exit status is 1).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from jaxes import cli

OUTPUT = "mc_probe.json"


def probe_run(workdir: str, versions: list[str], path: str, log=print) -> dict[int, dict]:
  """``{version: measures}`` of the run's checkpoints ``versions`` (ints, or ``last``), written to
  ``workdir/mc_probe.json`` (merged with the versions scored before)."""
  from jaxes.train import mc_probe, metrics
  from jaxes.train.policy import load_policy
  out = {}
  for v in versions:
    policy = load_policy(workdir, None if v == "last" else int(v))
    scored = mc_probe.Probe(policy.graphdef, path, policy.tokenizer)(policy.params)
    out[policy.version] = scored
    log(f"{workdir}: version {policy.version}: accuracy {scored['accuracy']:.3f} ± {scored['stderr']:.3f}, "
        f"answer log-prob {scored['answer_logprob']:.4f} per token ({scored['items']} items, "
        f"chance {scored['chance']:.3f})")
  target = os.path.join(workdir, OUTPUT)
  before = metrics.read_json(target) or {}
  recorded = before.get("versions", {}) if before.get("file") == path else {}
  recorded |= {str(k): v for k, v in out.items()}
  with open(target + ".tmp", "w") as f:
    json.dump({"file": path, "versions": recorded}, f, indent=2)
  os.replace(target + ".tmp", target)
  return out


def by_variant(results: dict[str, dict[int, dict]]) -> list[str]:
  """Lines per grid variant (run directories named ``<variant>-s<seed>``) with 2+ versions."""
  from jaxes.train.metrics import mean_stderr
  groups: dict[str, list[dict[int, dict]]] = {}
  for workdir, scored in results.items():
    m = re.fullmatch(r"(.+)-s\d+", os.path.basename(os.path.normpath(workdir)))
    if m and len(scored) >= 2:
      groups.setdefault(m.group(1), []).append(scored)
  lines = []
  for variant, runs in sorted(groups.items()):
    first = [r[min(r)] for r in runs]
    last = [r[max(r)] for r in runs]
    cells = []
    for key, fmt in (("accuracy", ".3f"), ("answer_logprob", ".4f")):
      mean, se = mean_stderr([x[key] for x in last])
      dm, dse = mean_stderr([b[key] - a[key] for a, b in zip(first, last)])
      cells.append(f"{key} {mean:{fmt}} ± {se:{fmt}} (change {dm:+{fmt}} ± {dse:{fmt}})")
    lines.append(f"{variant} ({len(runs)} runs, last version): " + ", ".join(cells))
  return lines


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxes.run_tools.probe", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", help="run directories")
  parser.add_argument("--versions", default="0,last", help="checkpointed versions, 'last' = newest")
  parser.add_argument("--file", default="bundled", help="'bundled' or a JSONL file of items")
  args = parser.parse_args(argv)
  versions = [v.strip() for v in args.versions.split(",") if v.strip()]
  if not versions or any(v != "last" and not v.isdigit() for v in versions):
    cli.usage_error("probe", f"--versions={args.versions}: checkpointed versions or 'last', e.g. 0,last")
  cli.start_jax()
  from jaxes.train import checkpoint, mc_probe
  from jaxes.train.policy import PolicyLoadError
  path = mc_probe.resolve(args.file)
  try:
    mc_probe.load_items(path or "")
  except ValueError as e:
    cli.usage_error("probe", f"--file: {e}")
  results, failed = {}, 0
  for workdir in args.workdirs:
    try:
      results[workdir] = probe_run(workdir, versions, path)
    except (PolicyLoadError, checkpoint.CheckpointError) as e:
      print(f"probe: skipped: {e}", file=sys.stderr)
      failed += 1
  for line in by_variant(results):
    print(line)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  main()

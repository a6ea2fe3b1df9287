"""Do two runs agree? ``python -m jaxes.run_tools.compare RUN_A RUN_B``.

The check of a multi-process rehearsal against one process (``launch/local.sh 2 -- python -m
jaxes.train ...`` beside the same command on one process with as many devices,
docs/multihost.md), or of a killed-and-resumed run against an uninterrupted one. It compares:

* the config each run's updates were trained under: ``config.json`` and the changes a rerun
  recorded in ``config_history.json`` (from which version on), keys free to change left out;
* every metrics line without its timings: the cohorts, staleness tags, fitness, pair ties,
  drops and evaluation outcomes. ``update_norm`` and the drift measures (``param_drift``,
  ``kl_to_initial``, ``update_cosine``, the multiple-choice probe's ``mc_probe``) are compared
  to a relative tolerance, since they are sums over the parameter's shards, whose reduction
  order follows the mesh; each evaluated version's drift, probe success and multiple-choice
  probe accuracy are printed side by side;
* the controller's state in the newest checkpoint (its jobs, tags and bookkeeping);
* the newest checkpoint's parameters, leaf by leaf: bit-identical, or the largest difference.

Prints one line per check and exits 0 iff all of them agree (1 if not, 2 if a run cannot be
read).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from jaxes import cli

if __name__ == "__main__":   # a command: JAX starts quietly (cli.start_jax) before an import below loads it
  cli.start_jax(init_backends=False)

import jax
import numpy as np

from jaxes.train import checkpoint, config_history, metrics
from jaxes.train.policy import PolicyLoadError, load_policy

# Keys whose values are wall-clock measurements: they differ between any two runs.
TIMING_KEYS = ("time", "episodes_per_s", "tokens_per_s", "seconds", "update_s", "learner_tokens_per_s")
# The one float in a metrics line that is a cross-device reduction (see the module docstring).
NORM_KEY = "update_norm"
# The drift measures (jaxes.train.drift) are reductions over the parameters' shards too: compared
# to the same relative tolerance, wherever they sit in a line (the evaluation's, the update's).
# So are the multiple-choice probe's log-likelihood sums (``mc_probe``, jaxes.train.mc_probe).
DRIFT_KEYS = ("param_drift", "param_drift_groups", "kl_to_initial", "update_cosine", "mc_probe")


def drift_values(record) -> tuple[dict, dict[str, float]]:
  """``record`` without its drift measures, and those measures by path (``eval/param_drift``)."""
  values = {}

  def strip(x, path):
    if not isinstance(x, dict):
      return x
    out = {}
    for k, v in x.items():
      if k in DRIFT_KEYS:
        for name, value in (v.items() if isinstance(v, dict) else [(None, v)]):
          values["/".join(filter(None, (path, k, name)))] = value
      else:
        out[k] = strip(v, f"{path}/{k}" if path else k)
    return out

  return strip(record, ""), values


def without_timings(record):
  """``record`` with every timing key removed, at any depth."""
  if isinstance(record, dict):
    return {k: without_timings(v) for k, v in record.items() if k not in TIMING_KEYS}
  return record


def metrics_lines(workdir: str) -> list[dict]:
  """The run's metrics lines without their timings."""
  return [without_timings(r) for r in metrics.read_metrics(os.path.join(workdir, "metrics.jsonl"))]


def metrics_differences(a: list[dict], b: list[dict], norm_rtol: float = 1e-6) -> list[str]:
  """Where two runs' metrics lines (``metrics_lines``) disagree: one line per difference."""
  if len(a) != len(b):
    return [f"{len(a)} metrics lines against {len(b)}"]
  out = []
  for i, (x, y) in enumerate(zip(a, b)):
    (x, dx), (y, dy) = drift_values(x), drift_values(y)
    nx, ny = x.pop(NORM_KEY, None), y.pop(NORM_KEY, None)
    version = x.get("version", i)
    if (nx is None) != (ny is None) or (nx is not None and not np.isclose(nx, ny, rtol=norm_rtol, atol=0)):
      out.append(f"version {version}: {NORM_KEY} {nx} against {ny}")
    for key in sorted(set(dx) | set(dy)):
      a, b = dx.get(key), dy.get(key)
      if (a is None) != (b is None) or (a is not None and not np.isclose(a, b, rtol=norm_rtol, atol=1e-9)):
        out.append(f"version {version}: {key} {a} against {b}")
    for key in sorted(set(x) | set(y)):
      if x.get(key) != y.get(key):
        out.append(f"version {version}: {key} differs")
  return out


def drift_lines(a: list[dict], b: list[dict]) -> list[str]:
  """``drift: version v: param_drift A / B, kl_to_initial A / B, probe success A / B, mc probe
  accuracy A / B`` for every evaluated version of either run (what each moved from version 0 and
  kept off-task)."""
  def by_version(lines):
    return {r["eval"]["version"]: r["eval"] for r in lines
            if "eval" in r and any(k in r["eval"] for k in ("param_drift", "probe", "mc_probe"))}
  ea, eb = by_version(a), by_version(b)
  fmt = lambda e, f: "—" if e is None or f(e) is None else f"{f(e):.4g}"
  out = []
  for v in sorted(set(ea) | set(eb)):
    x, y = ea.get(v), eb.get(v)
    parts = [f"{name} {fmt(x, f)} / {fmt(y, f)}" for name, f in (
        ("param_drift", lambda e: e.get("param_drift")), ("kl_to_initial", lambda e: e.get("kl_to_initial")),
        ("probe success", lambda e: (e.get("probe") or {}).get("success")),
        ("mc probe accuracy", lambda e: (e.get("mc_probe") or {}).get("accuracy")))]
    out.append(f"drift: version {v}: " + ", ".join(parts))
  return out


def config_differences(run_a: str, run_b: str) -> list[str]:
  """Where the configs in force of two runs' updates differ (``config_history.segments``): one
  line per version from which on they differ, naming each key with both values."""
  seg_a, seg_b = config_history.segments(run_a), config_history.segments(run_b)
  for run, seg in ((run_a, seg_a), (run_b, seg_b)):
    if seg is None:
      raise PolicyLoadError(f"{run}: no config.json (not a run directory of python -m jaxes.train)")
  at = lambda seg, v: [config for since, config in seg if since <= v][-1]
  out, last = [], None
  for v in sorted({since for since, _ in seg_a + seg_b}):
    a, b = at(seg_a, v), at(seg_b, v)
    diff = [f"{k.removeprefix('config.')} {a.get(k)!r} against {b.get(k)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff and diff != last:
      out.append(f"after version {v}: " + ", ".join(diff))
    last = diff
  return out


def final_controller(workdir: str) -> tuple[int, dict]:
  """(version, the controller's state) of the run's newest checkpoint."""
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise PolicyLoadError(f"{workdir}: not a run directory (no checkpoints/ in it)")
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    steps = ckpt.steps()
    if not steps:
      raise PolicyLoadError(f"{workdir}: the run has no checkpoint yet")
    return steps[-1], ckpt.restore_host(steps[-1])["controller"]
  finally:
    ckpt.close()


def param_differences(a, b) -> dict[str, float]:
  """Largest |a - b| of every leaf that differs (empty: bit-identical). Leaves are named by
  their path; a structure or shape mismatch raises ValueError."""
  named_a = jax.tree_util.tree_flatten_with_path(a)[0]
  named_b = jax.tree_util.tree_flatten_with_path(b)[0]
  if [p for p, _ in named_a] != [p for p, _ in named_b]:
    raise ValueError("the two parameter trees have different leaves")
  out = {}
  for (path, x), (_, y) in zip(named_a, named_b):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape:
      raise ValueError(f"{jax.tree_util.keystr(path)}: shape {x.shape} against {y.shape}")
    if not np.array_equal(x, y):
      out[jax.tree_util.keystr(path)] = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
  return out


def compare(run_a: str, run_b: str, norm_rtol: float = 1e-6, log=print) -> bool:
  """Logs one line per check; True iff the runs agree on all of them."""
  agree = True
  # Both runs are read before anything is printed, so an unreadable one is the only line.
  (version_a, ctrl_a), (version_b, ctrl_b) = final_controller(run_a), final_controller(run_b)
  lines_a, lines_b = metrics_lines(run_a), metrics_lines(run_b)
  for run, lines in ((run_a, lines_a), (run_b, lines_b)):
    if not lines:
      raise PolicyLoadError(f"{run}: no metrics lines (metrics.jsonl missing or empty)")
  configs = config_differences(run_a, run_b)
  log("config: " + ("the same for every update (config.json and config_history.json; keys free to "
                    "change left out)" if not configs else "DIFFERS " + "; ".join(configs[:5])))
  agree &= not configs
  diffs = metrics_differences(lines_a, lines_b, norm_rtol)
  log(f"metrics: {len(lines_a)} lines " + ("identical (timings left out; update norms within "
                                             f"{norm_rtol:g} relative)" if not diffs else
                                             f"DIFFER in {len(diffs)} places: " + "; ".join(diffs[:5])))
  agree &= not diffs
  for line in drift_lines(lines_a, lines_b):
    log(line)
  same = version_a == version_b and ctrl_a == ctrl_b
  log(f"controller at versions {version_a} / {version_b}: " + ("identical" if same else "DIFFERS"))
  agree &= same
  policy_a, policy_b = load_policy(run_a), load_policy(run_b)
  # load_policy falls back past an unreadable newest checkpoint: parameters of another version
  # than the controller's above would be compared under its name.
  fallen_back = [f"{run} loaded version {p.version}, its newest checkpoint is {v}"
                 for run, p, v in ((run_a, policy_a, version_a), (run_b, policy_b, version_b))
                 if p.version != v]
  if fallen_back:
    log("parameters: NOT of the versions named above: " + "; ".join(fallen_back) +
        " (unreadable; a rerun of the run sets it aside and writes it again)")
    return False
  diffs = param_differences(policy_a.params, policy_b.params)
  count = len(jax.tree.leaves(policy_a.params))
  if diffs:
    worst = max(diffs, key=diffs.get)
    log(f"parameters: {len(diffs)} of {count} leaves DIFFER, largest |delta| {diffs[worst]:.3g} in {worst}")
  else:
    versions = (f"version {policy_a.version}" if policy_a.version == policy_b.version else
                f"versions {policy_a.version} / {policy_b.version}")
    log(f"parameters of {versions}: all {count} leaves bit-identical")
  return agree and not diffs


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_a", help="a run directory")
  parser.add_argument("run_b", help="the run directory to compare it with")
  parser.add_argument("--norm_rtol", type=float, default=1e-6,
                      help="relative tolerance of update_norm (a cross-device sum)")
  args = parser.parse_args(argv)
  cli.start_backends()   # the CUDA plugin's start-up lines dropped (jaxes.cli)
  try:
    with warnings.catch_warnings(record=True) as said:   # a skipped corrupt step: one line each
      warnings.simplefilter("always", RuntimeWarning)
      agree = compare(args.run_a, args.run_b, args.norm_rtol)
    for w in said:
      print(f"compare: {w.message}", file=sys.stderr)
  except (PolicyLoadError, checkpoint.CheckpointError, ValueError) as e:
    print(f"compare: {e}", file=sys.stderr)
    sys.exit(2)
  print("the runs agree" if agree else "the runs differ")
  sys.exit(0 if agree else 1)


if __name__ == "__main__":
  main()

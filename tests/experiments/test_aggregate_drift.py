"""Drift and probes where a researcher reads them: the run report, the grid's table and report,
and compare's side-by-side lines and tolerances (synthetic records: no training)."""
import json
import os

import pytest

from jaxes.experiments import aggregate, plots, rundirs
from jaxes.experiments.variants import Variant
from jaxes.run_tools import compare, probe, report


def _eval(version, drift, kl, probe, mc=0.5):
  return {"version": version, "eval": {
      "version": version, "success": 0.2, "stderr": 0.1, "reward": 0.3, "reward_stderr": 0.1,
      "param_drift": drift, "kl_to_initial": kl, "update_cosine": None,
      "param_drift_groups": {"embeddings": drift / 2, "attention": 0.0, "mlp": drift / 3, "norms": 0.0},
      "probe": {"success": probe, "stderr": 0.05, "reward": probe, "reward_stderr": 0.05},
      "mc_probe": {"accuracy": mc, "stderr": 0.09, "accuracy_per_token": mc, "answer_logprob": -2.5,
                   "items": 32, "chance": 0.26}}}


def test_run_report_shows_drift_kl_cosine_and_probe(tmp_path):
  lines = [_eval(0, 0.0, 0.0, 0.25), _eval(6, 1.5, 0.02, 0.125)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  page = report.render(str(tmp_path))
  assert "distance from version 0" in page and "KL(π_θ₀ ‖ π_θv)" in page
  assert "probe success (off-task)" in page and "multiple-choice probe accuracy" in page
  assert "multiple-choice" not in report.heldout_chart([e["eval"] for e in lines], "reward", "reward_stderr", "r")
  cosine = report.drift_charts([], [{"version": 2, "update_cosine": -0.4}, {"version": 3, "update_cosine": 0.1}])
  assert len(cosine) == 1 and "cosine between consecutive updates" in cosine[0]
  assert report.drift_charts([{"version": 0, "success": 0.1}], []) == []   # a run without drift


def test_compare_prints_drift_side_by_side_and_tolerates_reduction_order():
  a = [_eval(0, 0.0, 0.0, 0.25), _eval(6, 1.5, 0.02, 0.125), {"version": 7, "update_cosine": 0.3}]
  b = json.loads(json.dumps(a))
  b[1]["eval"]["param_drift"] *= 1 + 1e-8   # another mesh's sum
  b[2]["update_cosine"] += 1e-10
  b[1]["eval"]["mc_probe"]["answer_logprob"] *= 1 + 1e-8
  assert compare.metrics_differences(a, b) == []
  b[1]["eval"]["param_drift_groups"]["mlp"] = 9.0
  b[1]["eval"]["mc_probe"]["accuracy"] = 0.375
  assert compare.metrics_differences(a, b) == ["version 6: eval/mc_probe/accuracy 0.5 against 0.375",
                                               "version 6: eval/param_drift_groups/mlp 0.5 against 9.0"]
  assert compare.drift_lines(a, b)[1] == ("drift: version 6: param_drift 1.5 / 1.5, kl_to_initial "
                                          "0.02 / 0.02, probe success 0.125 / 0.125, mc probe accuracy "
                                          "0.5 / 0.375")


def _grid_run(path, seed, drift):
  evals = [_eval(0, 0.0, 0.0, 0.25), _eval(2, drift, 0.01, 0.125)]
  train = [{"version": v, "staleness_hist": [4], "time": {"wall_s": 5.0}, "train": {"success": 0.0},
            "dropped": 0, "delayed": 0, "excluded": 0} for v in (1, 2)]
  os.makedirs(path)
  json.dump({"seed": seed, "train": {"num_updates": 2}}, open(os.path.join(path, "config.json"), "w"))
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in train + evals)
  json.dump({"version": 2, "before": evals[0]["eval"], "after": evals[1]["eval"]},
            open(os.path.join(path, "summary.json"), "w"))
  json.dump({"attempts": [{"command": ["x"], "returncode": 0, "wall_s": 1.0, "cpu_s": 1.0}]},
            open(os.path.join(path, rundirs.GRID_RUN), "w"))


def test_grid_table_and_report_carry_drift(tmp_path):
  for variant, drift in (("sync", 2.0), ("sync_l2", 1.0)):
    for seed in (0, 1):
      _grid_run(str(tmp_path / rundirs.run_name(variant, seed)), seed, drift + seed)
  result = aggregate.aggregate([Variant("sync", "c.py:sync", {}), Variant("sync_l2", "c.py:sync_l2", {})],
                               [0, 1], str(tmp_path))
  by = {v["variant"]: v for v in result["variants"]}
  assert by["sync"]["final_param_drift"]["mean"] == 2.5 and by["sync_l2"]["final_param_drift"]["mean"] == 1.5
  assert by["sync"]["final_probe"]["mean"] == 0.125 and by["sync"]["final_kl_to_initial"]["mean"] == 0.01
  assert by["sync"]["final_mc_probe"]["mean"] == 0.5
  assert "| sync_l2 | 1.500 ± 0.500 | 0.0100 ± 0.0000 | 0.125 ± 0.000 | 0.500 ± 0.000 |" in aggregate.to_markdown(result)
  html = plots.grid_html(result)
  assert "(param_drift)" in html and "KL(π_θ₀ ‖ π_θv)" in html and "probe success" in html
  assert "multiple-choice probe accuracy" in html


def test_grid_reads_probes_scored_after_the_run(tmp_path):
  for seed in (0, 1):
    path = str(tmp_path / rundirs.run_name("sync", seed))
    _grid_run(path, seed, 2.0)
    lines = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    for r in lines:   # a run trained without eval.mc_probe_file
      r.get("eval", {}).pop("mc_probe", None)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in lines)
    json.dump({"file": "bundled", "versions": {"0": {"accuracy": 0.25}, "2": {"accuracy": 0.5 + seed / 4}}},
              open(os.path.join(path, probe.OUTPUT), "w"))
  result = aggregate.aggregate([Variant("sync", "c.py:sync", {})], [0, 1], str(tmp_path))
  assert result["variants"][0]["final_mc_probe"]["mean"] == 0.625
  assert [e["mc_probe"] for e in result["runs"][0]["evals"]] == [0.25, 0.5]


def test_probe_tool_summarises_a_grids_runs_and_refuses_bad_versions(capsys):
  scored = lambda acc, lp: {"accuracy": acc, "answer_logprob": lp}
  lines = probe.by_variant({"g/sync-s0": {0: scored(0.25, -3.0), 48: scored(0.5, -2.0)},
                            "g/sync-s1": {0: scored(0.25, -3.0), 48: scored(0.25, -3.0)},
                            "g/one": {0: scored(0.0, 0.0), 1: scored(0.0, 0.0)},   # not a grid's run
                            "g/sao-s0": {48: scored(0.5, -1.0)}})                  # one version only
  assert lines == ["sync (2 runs, last version): accuracy 0.375 ± 0.125 (change +0.125 ± 0.125), "
                   "answer_logprob -2.5000 ± 0.5000 (change +0.5000 ± 0.5000)"]
  with pytest.raises(SystemExit) as exit_:
    probe.main(["run", "--versions=first"])
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_.value.code == 2 and err == ["probe: --versions=first: checkpointed versions or 'last', e.g. 0,last"]

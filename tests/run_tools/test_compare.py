"""`python -m jaxes.run_tools.compare`: what counts as agreeing runs. The end-to-end use (a 2-process
run against 1 process, compared by `compare.compare`) is tests/end_to_end/test_multihost_train.py."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxes.run_tools import compare

LINE = {"version": 1, "staleness_hist": [6, 2], "update_norm": 0.5, "episodes_per_s": 3.0,
        "train": {"success": 0.25, "failures": {"none": 2}}, "time": {"wall_s": 9.0},
        "eval": {"success": 0.5, "seconds": 12.0}}


def test_timings_are_left_out_at_every_depth():
  assert compare.without_timings(LINE) == {
      "version": 1, "staleness_hist": [6, 2], "update_norm": 0.5,
      "train": {"success": 0.25, "failures": {"none": 2}}, "eval": {"success": 0.5}}


def test_metrics_agree_up_to_timings_and_the_norms_tolerance():
  a = [compare.without_timings(LINE)]
  other_timings = {**LINE, "episodes_per_s": 7.0, "time": {"wall_s": 1.0}}
  assert compare.metrics_differences(a, [compare.without_timings(other_timings)]) == []
  close = {**a[0], "update_norm": 0.5 * (1 + 1e-7)}
  assert compare.metrics_differences(a, [close]) == []
  far = {**a[0], "update_norm": 0.5 * (1 + 1e-5)}
  assert compare.metrics_differences(a, [far]) == [f"version 1: update_norm 0.5 against {far['update_norm']}"]
  assert compare.metrics_differences(a, [far], norm_rtol=1e-4) == []
  tagged = {**a[0], "staleness_hist": [7, 1]}
  assert compare.metrics_differences(a, [tagged]) == ["version 1: staleness_hist differs"]
  assert compare.metrics_differences(a, a + a) == ["1 metrics lines against 2"]


def test_parameters_agree_only_bit_for_bit():
  a = {"layers": {"w": jnp.arange(6.0).reshape(2, 3)}, "b": jnp.ones(3, jnp.bfloat16)}
  assert compare.param_differences(a, {"layers": {"w": a["layers"]["w"] + 0}, "b": a["b"]}) == {}
  nudged = {"layers": {"w": a["layers"]["w"].at[1, 2].add(1e-6)}, "b": a["b"]}
  diffs = compare.param_differences(a, nudged)
  assert list(diffs) == ["['layers']['w']"] and np.isclose(diffs["['layers']['w']"], 1e-6, rtol=0.1)
  with pytest.raises(ValueError, match="shape"):
    compare.param_differences(a, {"layers": {"w": jnp.zeros((3, 2))}, "b": a["b"]})
  with pytest.raises(ValueError, match="different leaves"):
    compare.param_differences(a, {"b": a["b"]})


def test_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "metrics.jsonl").write_text('{"version": 0}\n')
  with pytest.raises(SystemExit) as exit_:
    compare.main([str(tmp_path / "a"), str(tmp_path / "b")])
  assert exit_.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("compare: ") and "no checkpoints/" in err[0]
  assert not (tmp_path / "a" / "checkpoints").exists()   # reading a run never creates one


def _run_dir(path, num_updates, history=()):
  path.mkdir()
  (path / "config.json").write_text(json.dumps({"es": {"sigma": 0.005}, "train": {"num_updates": num_updates}}))
  if history:
    (path / "config_history.json").write_text(json.dumps(list(history)))
  return str(path)


def test_configs_are_compared_version_by_version_through_the_history(tmp_path):
  changed = {"since_version": 2, "changes": [{"key": "config.es.sigma", "old": 0.005, "new": 0.05},
                                              {"key": "config.train.num_updates", "old": 2, "new": 4}]}
  extended = {"since_version": 2, "changes": [{"key": "config.train.num_updates", "old": 2, "new": 4}]}
  a = _run_dir(tmp_path / "a", 2, [changed])
  plain = _run_dir(tmp_path / "plain", 4)
  assert compare.config_differences(a, plain) == ["after version 2: es.sigma 0.05 against 0.005"]
  # Extending a run (a key free to change) trains nothing differently from running it whole.
  assert compare.config_differences(_run_dir(tmp_path / "ext", 2, [extended]), plain) == []
  assert compare.config_differences(a, _run_dir(tmp_path / "a2", 2, [changed])) == []
  with pytest.raises(compare.PolicyLoadError, match="no config.json"):
    compare.config_differences(a, str(tmp_path))

"""What a rerun does to a run directory: a refused config change writes nothing, an allowed one
is in the history and the metrics, a rerun of a finished run keeps the run's totals; bad
workdirs, a missing run to compare and an unknown checker agent are one line with exit 2."""
import hashlib
import io
import json
import pathlib
import subprocess
import sys

import pytest

from helpers_train import ROOT, build_tiny_tokenizer, tiny_config, write_config_file
from jaxes.envs import check
from jaxes.errors import RunStateError
from jaxes.experiments import rundirs
from jaxes.run_tools import compare, export
from jaxes.train import config_history, metrics
from jaxes.train.metrics import ProgressBar
from jaxes.train.policy import load_policy
from jaxes.train.trainer import Trainer

QUIET = dict(log=lambda s: None)
BASE = {"controller.mode": "sync", "controller.max_staleness": 0, "eval.num_tasks": 0,
        "train.plot": False}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished 2-update run (copied by tests that change it)."""
  tok = build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
  workdir = tmp_path_factory.mktemp("runs") / "done"
  config = tiny_config(tok, **BASE)
  Trainer(config, str(workdir), **QUIET).run()
  return workdir, config


def _digest(root) -> dict:
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}


def _copy(src, dst):
  subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
  return dst


def _changed_config(config, **more):
  return tiny_config(config.tokenizer.path, **{**BASE, "es.sigma": 0.05, "es.learning_rate": 0.03,
                                                  "train.num_updates": 3, **more})


@pytest.fixture(scope="module")
def changed(finished, tmp_path_factory):
  """The finished run, refused a change of sigma and learning rate, then extended by one update
  under it with --allow_config_change: (workdir, the files' digests before and after the refused
  rerun, the config). (A constant sigma does not enter the update, the learning rate does.)"""
  src, config = finished
  workdir = _copy(src, tmp_path_factory.mktemp("runs") / "changed")
  before = _digest(workdir)
  with pytest.raises(RunStateError, match=r"config.es.learning_rate was 0.01 there, is 0.03 here; "
                                          r"config.es.sigma was 0.005 there, is 0.05 here"
                                          r".*--allow_config_change"):
    Trainer(_changed_config(config), str(workdir), **QUIET).run()
  after_refusal = _digest(workdir)
  Trainer(_changed_config(config), str(workdir), allow_config_change=True, **QUIET).run()
  return workdir, before, after_refusal, config


@pytest.mark.end_to_end
def test_refused_change_writes_nothing_and_allowed_one_is_recorded(changed, tmp_path):
  src, before, after_refusal, config = changed
  assert after_refusal == before   # every file byte-identical, config.json included
  workdir = _copy(src, tmp_path / "run")
  assert json.loads((workdir / "config.json").read_text())["es"]["sigma"] == 0.005   # the original
  assert config_history.history(str(workdir)) == [{"since_version": 2, "changes": [
      {"key": "config.es.learning_rate", "old": 0.01, "new": 0.03},
      {"key": "config.es.sigma", "old": 0.005, "new": 0.05},
      {"key": "config.train.num_updates", "old": 2, "new": 3}]}]
  lines = [r for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert [r.get("config_in_force") for r in lines] == [None, None, {"es.learning_rate": 0.03, "es.sigma": 0.05}]
  assert lines[-1]["sigma"] == pytest.approx(0.05)
  # The same changed config again: in force already, so nothing to refuse or record.
  Trainer(_changed_config(config), str(workdir), **QUIET).run()
  assert len(config_history.history(str(workdir))) == 1
  # Extending the run is free (no flag), and recorded.
  Trainer(_changed_config(config, **{"train.num_updates": 4}), str(workdir), **QUIET).run()
  assert config_history.history(str(workdir))[-1] == {"since_version": 3, "changes": [
      {"key": "config.train.num_updates", "old": 3, "new": 4}]}
  # The grid's view follows the history: finished at 4, though config.json still asks for 2.
  assert rundirs.final_version(str(workdir)) == 4 and rundirs.is_finished(str(workdir))


@pytest.mark.end_to_end
def test_load_policy_and_export_carry_the_changes_a_version_was_trained_under(changed, tmp_path):
  src, _, _, _ = changed
  entry = config_history.history(str(src))[0]
  assert load_policy(str(src), 3).config_changes == [entry]   # update 3 ran after the change
  assert load_policy(str(src), 2).config_changes == []
  export.main([f"--workdir={src}", "--version=3", f"--out={tmp_path / 'hf'}"])
  written = json.loads((tmp_path / "hf" / "jaxes_config_history.json").read_text())
  assert written["version"] == 3 and written["config_changes"] == [entry]
  export.main([f"--workdir={src}", "--version=2", f"--out={tmp_path / 'hf2'}"])
  assert not (tmp_path / "hf2" / "jaxes_config_history.json").exists()


def _truncate_largest_chunk(step_dir):
  chunks = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
  max(chunks, key=lambda f: f.stat().st_size).write_bytes(b"")


@pytest.mark.end_to_end
def test_a_run_changed_mid_way_falls_back_across_the_change_and_replays_to_its_version(changed, tmp_path):
  """With steps 2 and 3 corrupt, a rerun restores step 1 and replays the logged updates 2 and 3
  (3 made after the allowed change) to version 3's parameters; each skipped step is one warning
  that names tensorstore's read error. (This tiny run's updates are zero steps, so it does not
  show that update 2 is replayed at the learning rate it was made with.)"""
  src, _, _, config = changed
  workdir = _copy(src, tmp_path / "run")
  steps = workdir / "checkpoints"
  assert sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) == [0, 1, 2, 3]
  for step in (2, 3):
    _truncate_largest_chunk(steps / str(step))
  trainer = Trainer(_changed_config(config), str(workdir), **QUIET)
  with pytest.warns(RuntimeWarning, match="step 3 .* corrupt") as said:
    trainer.run()
  assert trainer.state.restored_from == 1 and trainer.state.version == 3
  assert not [str(w.message) for w in said if "<bound method" in str(w.message)]
  diffs = compare.param_differences(trainer.state.params_by_version[3], load_policy(str(src), 3).params)
  assert diffs == {}, diffs


@pytest.mark.end_to_end
def test_rerun_of_a_finished_run_keeps_the_totals(finished, tmp_path):
  src, config = finished
  workdir = _copy(src, tmp_path / "run")
  first = json.loads((workdir / "summary.json").read_text())
  windows = [r["time"]["wall_s"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert first["train_s"] == pytest.approx(sum(windows)) and first["this_invocation"]["updates"] == 2
  again = Trainer(config, str(workdir), **QUIET).run()
  assert (again["train_s"], again["updates_per_hour"]) == (first["train_s"], first["updates_per_hour"])
  assert again["this_invocation"]["updates"] == 0 and again["this_invocation"]["updates_per_hour"] is None
  assert json.loads((workdir / "summary.json").read_text())["train_s"] == first["train_s"]


def test_compare_names_the_missing_run_first(finished, tmp_path, capsys):
  src, _ = finished
  with pytest.raises(SystemExit) as exit_:
    compare.main([str(src), str(tmp_path / "missing")])
  assert exit_.value.code == 2
  out = capsys.readouterr()
  assert out.out == "" and out.err.strip().splitlines() == [
      f"compare: {tmp_path / 'missing'}: not a run directory (no checkpoints/ in it)"]


def test_unknown_checker_agent_is_a_set_up_error(capsys):
  assert check.main(["--generated", "1", "--agent", "foo"]) == 2
  assert capsys.readouterr().err.strip() == "check: --agent 'foo': expected oracle, noop or replay:FILE"


@pytest.mark.end_to_end
@pytest.mark.parametrize("inside", [False, True])
def test_workdir_that_is_a_file_or_inside_one_is_one_line(finished, tmp_path, inside):
  _, config = finished
  (tmp_path / "f").write_text("not a directory")
  workdir = tmp_path / "f" / "run" if inside else tmp_path / "f"
  done = subprocess.run([sys.executable, "-m", "jaxes.train", f"--config={write_config_file(config, tmp_path / 'c.py')}",
                         f"--workdir={workdir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: --workdir={workdir}: ") and (
      "cannot create it (Not a directory)" if inside else "is a file") in last
  assert (tmp_path / "f").read_text() == "not a directory"


@pytest.mark.end_to_end
def test_export_of_a_run_whose_newest_checkpoint_is_corrupt_falls_back_and_says_so(finished, tmp_path, capsys):
  src, _ = finished
  workdir = _copy(src, tmp_path / "run")
  for f in (workdir / "checkpoints" / "2").rglob("*"):
    if f.is_file() and f.stat().st_size > 256 and "meta" not in f.relative_to(workdir / "checkpoints" / "2").parts[0]:
      data = bytearray(f.read_bytes())
      data[128:192] = bytes(b ^ 0xFF for b in data[128:192])
      f.write_bytes(bytes(data))
  export.main([f"--workdir={workdir}", f"--out={tmp_path / 'hf'}"])
  out = capsys.readouterr()
  err = out.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("export: checkpoint step 2 in ") and "corrupt" in err[0], err
  assert "loading the previous step" in err[0] and "<bound method" not in err[0]
  assert out.out.startswith("exported version 1 of ")
  with pytest.raises(SystemExit) as exit_:   # asked for exactly the corrupt step: named, rc 2
    export.main([f"--workdir={workdir}", "--version=2", f"--out={tmp_path / 'hf2'}"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "checkpoint step 2 in " in err[0] and "corrupt" in err[0], err


def test_progress_bar_says_compiling_until_the_first_update_then_times_from_there():
  out = io.StringIO()
  bar = ProgressBar(3, 0, file=out)
  assert out.getvalue().rstrip().endswith("0/3 [compiling…]")
  bar.update({"train": {"success": 0.5}, "staleness_mean": 0.0, "episodes_per_s": 1.0})
  # No rate yet: the first update (its compiles) is not part of the estimate.
  assert "1/3 [00:00<?, ?upd/s" in out.getvalue().split("\r")[-1]
  bar.close()


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_extending_a_run_is_free_only_while_sigma_is_constant(tmp_path, schedule):
  config = tiny_config("tok", **{"es.sigma_schedule": schedule, "es.sigma_final": 0.001})
  config_history.write_original(str(tmp_path), config)
  longer = tiny_config("tok", **{"es.sigma_schedule": schedule, "es.sigma_final": 0.001,
                                 "train.num_updates": 5})
  if schedule == "constant":
    assert [c.key for c in config_history.check_rerun(str(tmp_path), longer, False)] == ["config.train.num_updates"]
  else:   # the schedule's length is the run's: every later sigma would change
    with pytest.raises(RunStateError, match="config.train.num_updates was 2 there, is 5 here"):
      config_history.check_rerun(str(tmp_path), longer, False)


def test_a_run_recorded_before_a_key_existed_reruns_at_that_keys_default(tmp_path):
  config = tiny_config("tok")
  config_history.write_original(str(tmp_path), config)
  path = tmp_path / config_history.CONFIG
  recorded = json.loads(path.read_text())
  del recorded["eval"]["mc_probe_file"]   # as an earlier jaxes, without the key, recorded it
  path.write_text(json.dumps(recorded))
  assert config_history.check_rerun(str(tmp_path), config, False) == []
  assert config_history.changed_in_force(str(tmp_path), config) == {}   # nothing for the metrics lines
  config.eval.mc_probe_file = "bundled"   # not the default it ran with: a change like any other
  with pytest.raises(RunStateError, match="config.eval.mc_probe_file was '' there, is 'bundled' here"):
    config_history.check_rerun(str(tmp_path), config, False)

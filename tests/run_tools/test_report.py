"""The run report: a tiny real run writes report.html and episodes.jsonl; headless Chromium renders
it with the curves and a transcript, and a hostile transcript stays text."""
import json
import os
import shutil
import subprocess

import pytest

from helpers_train import build_tiny_tokenizer, tiny_config
from jaxes.run_tools import report
from jaxes.train.trainer import Trainer
from jaxes.train.transcripts import EPISODES, clip

HOSTILE = ('<script>document.body.setAttribute("data-pwned", "1")</script>'
           '<img src=x onerror="document.body.setAttribute(\'data-pwned\', \'2\')">')


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("report")
  c = tiny_config(build_tiny_tokenizer(str(tmp / "tok")))
  c.train.num_updates, c.train.plot, c.train.transcripts_per_update = 1, False, 2
  workdir = str(tmp / "run")
  Trainer(c, workdir, log=lambda s: None, write_report=report.write).run()
  return workdir


def test_trainer_writes_report_and_bounded_sample(run_dir):
  episodes = [json.loads(line) for line in open(os.path.join(run_dir, EPISODES))]
  assert len(episodes) == 2 and {e["update"] for e in episodes} == {1}
  roles = [t["role"] for t in episodes[0]["transcript"]]
  assert roles[:2] == ["prompt", "model"]
  page = open(os.path.join(run_dir, "report.html")).read()
  assert "held-out success per version" in page and episodes[0]["task"] in page


def test_clip_keeps_head_and_tail():
  text = "a" * 50 + "b" * 50
  out = clip(text, 20)
  assert out.startswith("a" * 10) and out.endswith("b" * 10) and "80 characters cut" in out


def test_cli_rejects_a_directory_without_metrics(tmp_path, capsys):
  assert report.main([f"--workdir={tmp_path}"]) == 2
  assert "no metrics.jsonl" in capsys.readouterr().err


def _chromium():
  return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.chromium
def test_browser_renders_curves_and_keeps_hostile_transcript_as_text(run_dir, tmp_path):
  workdir = tmp_path / "hostile"
  shutil.copytree(run_dir, workdir, ignore=shutil.ignore_patterns("checkpoints", "tensorboard"))
  with open(workdir / EPISODES, "a") as f:
    f.write(json.dumps({"update": 1, "task": "evil" + HOSTILE, "member": 0, "version": 0, "reward": 0.0,
                        "passed": False, "turns": 1, "failure": None, "truncated": False,
                        "transcript": [{"role": "model", "text": HOSTILE}]}) + "\n")
  assert report.main([f"--workdir={workdir}"]) == 0
  dom = subprocess.run(
      [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
       "--disable-component-update", "--disable-sync", "--no-first-run",
       f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"file://{workdir / 'report.html'}"],
      capture_output=True, text=True, timeout=120, check=True).stdout
  assert dom.count('id="curve') >= 3                         # SVG curves are in the DOM
  assert dom.count('class="episode"') == 3 and '<pre class="model">' in dom   # transcripts
  assert "data-pwned" not in dom.split("<body", 1)[1].split(">", 1)[0]      # no script ran
  assert "<script" not in dom and "<img" not in dom and "&lt;script&gt;document.body" in dom      # shown as text


def test_wandb_offline_logs_scalars_histogram_and_transcripts(run_dir, tmp_path, monkeypatch):
  pytest.importorskip("wandb", reason="wandb not installed (pip install wandb)")
  from jaxes.train import metrics, tracker
  from jaxes.train.transcripts import read_episodes
  monkeypatch.setenv("WANDB_MODE", "offline")   # no network: W&B writes its files locally
  monkeypatch.setenv("WANDB_SILENT", "true")
  episodes = read_episodes(os.path.join(run_dir, EPISODES))
  t = tracker.build("wandb", str(tmp_path), {"seed": 0})
  for record in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl")):
    if "train" in record:
      t.log(record, episodes)
  t.close()
  # finish() returns before wandb's service process has flushed the run file (it read 7 bytes
  # under load, the header alone); teardown waits for the service, as the trainer's exit does.
  import wandb
  wandb.teardown()
  (run,) = (tmp_path / "wandb").glob("offline-run-*")
  logged = (next(run.glob("*.wandb"))).read_bytes()
  assert b"train/success" in logged and b"staleness" in logged and b"histogram" in logged
  (table,) = run.glob("files/media/table/episodes_*.table.json")
  data = json.loads(table.read_text())
  assert data["columns"][-1] == "transcript" and episodes[0]["task"] in {row[1] for row in data["data"]}


def test_tracker_off_by_default_and_missing_package_is_one_line(monkeypatch):
  from jaxes.train import tracker
  assert tracker.build("", "/nonexistent", {}) is None
  monkeypatch.setitem(__import__("sys").modules, "wandb", None)   # import wandb raises ImportError
  lines = []
  assert tracker.build("wandb", "/nonexistent", {}, log=lines.append) is None
  assert len(lines) == 1 and "not installed" in lines[0]


def test_atif_export_of_the_sample(run_dir, tmp_path):
  from jaxes.run_tools import atif
  episodes = [json.loads(line) for line in open(os.path.join(run_dir, EPISODES))]
  out = str(tmp_path / "t.jsonl")
  assert atif.main([f"--workdir={run_dir}", f"--out={out}"]) == 0
  trajectories = [json.loads(line) for line in open(out)]
  assert len(trajectories) == len(episodes)
  for t, e in zip(trajectories, episodes):
    assert t["schema_version"] == "ATIF-v1.4" and t["agent"]["name"] == "jaxes"
    assert [s["step_id"] for s in t["steps"]] == list(range(1, len(t["steps"]) + 1))
    assert {s["source"] for s in t["steps"]} <= {"system", "user", "agent"}
    assert sum(s["source"] == "agent" for s in t["steps"]) == sum(x["role"] == "model" for x in e["transcript"])
    assert t["final_metrics"]["extra"]["reward"] == e["reward"]
  step = atif.trajectory({"transcript": [{"role": "model", "text": "<command>ls -la</command>"},
                                         {"role": "observation", "text": "out"}]}, "r", "m")["steps"][0]
  assert step["tool_calls"][0]["arguments"] == {"command": "ls -la"}
  assert step["observation"]["results"][0] == {"source_call_id": step["tool_calls"][0]["tool_call_id"],
                                               "content": "out"}


def test_sampler_keeps_per_update_and_drops_lines_past_the_resume_point(tmp_path):
  from types import SimpleNamespace as NS
  from jaxes.train.transcripts import TranscriptSampler, read_episodes
  path = tmp_path / EPISODES
  path.write_text("".join(json.dumps({"update": u, "task": "t"}) + "\n" for u in (1, 2, 3)))
  sampler = TranscriptSampler(str(tmp_path), None, per_update=2, max_chars=100, resume_version=2)
  assert [e["update"] for e in read_episodes(str(path))] == [1, 2]   # update 3 is redone
  task = NS(name="t<b>")
  for member in range(3):
    sampler.offer(NS(spec=NS(key=NS(job=NS(member=member, episode=0)), task=task, version=2, member=member),
                     reward=1.0, passed=True, turns=1, failure=None, truncated=False, tokens=None))
  written = sampler.write(3)
  assert [e["member"] for e in written] == [0, 1] and sampler.write(4) == []
  assert [e["update"] for e in read_episodes(str(path))] == [1, 2, 3, 3]


def test_a_task_name_that_is_not_utf8_is_written_escaped_and_kept(run_dir, tmp_path):
  from jaxes.run_tools import atif, report
  odd = os.fsdecode(b"task-\xff\xfe")     # a folder name in bytes that are not UTF-8
  workdir = tmp_path / "run"
  shutil.copytree(run_dir, workdir)
  lines = open(workdir / EPISODES).read().splitlines()
  first = json.loads(lines[0])
  first["task"] = odd
  (workdir / EPISODES).write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
  page = open(report.write(str(workdir)), encoding="utf-8").read()
  assert "task-\\udcff\\udcfe" in page
  out, _ = atif.export(str(workdir), str(tmp_path / "t.jsonl"))
  assert any(odd in line for line in (json.loads(x)["session_id"] for x in open(out)))

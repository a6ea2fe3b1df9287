"""End to end at tiny sizes: a few updates, resume == uninterrupted, no recompilation per update,
no sandbox left behind (also after an exception inside the loop)."""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from helpers_train import (ROOT, build_tiny_tokenizer, kill_when, tiny_config, train_records,
                           write_config_file)
from jaxes.envs.sandboxes import local_sandbox
from jaxes.envs.sandboxes.local_sandbox import LocalSandbox
from jaxes.envs.tasks import oracle
from jaxes.train import metrics
from jaxes.train.metrics import pair_ties
from jaxes.train.trainer import Trainer

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


# The sync runs below start from a short warm start; temperature sampling keyed by job id
# (common random numbers off), so members differ in reward (within antithetic pairs too) and the
# updates move theta. 8 slots: the programs of the other tests here (the compile cache).
SYNC = {"controller.mode": "sync", "controller.max_staleness": 0, "warmstart.steps": 60,
        "warmstart.learning_rate": 1e-2, "env.partial_credit": True, "eval.num_tasks": 0,
        "rollout.temperature": 0.4, "rollout.common_random_numbers": False,
        "rollout.num_slots": 8}


@pytest.fixture(scope="module")
def warm_start(tokenizer_dir, tmp_path_factory):
  """Version 0 of the sync runs, made once (``warmstart.init_from``), the SIGKILL test's launched
  process included. That a warm start does not depend on the process that makes it is
  tests/end_to_end/test_multihost_train.py's (two launched layouts warm-start to the same bits)."""
  workdir = str(tmp_path_factory.mktemp("warm") / "init")
  Trainer(tiny_config(tokenizer_dir, **{**SYNC, "train.num_updates": 0}), workdir,
          log=lambda s: None).run()
  return workdir


@pytest.fixture
def sandbox_root():
  # Under /tmp: the sandbox uid must be able to traverse every ancestor of the episode dirs.
  root = tempfile.mkdtemp(prefix="jaxes-test-train-")
  os.chmod(root, 0o711)
  yield os.path.join(root, "sandboxes")
  shutil.rmtree(root, ignore_errors=True)


def _first_divergence(workdir_a, workdir_b) -> str | None:
  """Where two runs' rollouts first differ (the update's reward summary, then its kept
  transcripts), or None: says whether unequal parameters came from the episodes or the update."""
  read = lambda w, name: metrics.read_metrics(os.path.join(w, name))
  a = {r["version"]: (r["train"], r["fitness"]) for r in read(workdir_a, "metrics.jsonl") if "train" in r}
  b = {r["version"]: (r["train"], r["fitness"]) for r in read(workdir_b, "metrics.jsonl") if "train" in r}
  for version in sorted(a.keys() & b.keys()):
    if a[version] != b[version]:
      episodes = [[e for e in read(w, "episodes.jsonl") if e["update"] == version] for w in (workdir_a, workdir_b)]
      first = next(((x, y) for x, y in zip(*episodes) if x != y), None)
      return f"update {version}: {a[version]} != {b[version]}; first differing episode: {first}"
  return None


def _params_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_few_updates_end_to_end_async_no_recompile_no_leftovers(tokenizer_dir, tmp_path, sandbox_root):
  compiles, at_update = [0], []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _secs, **_: compiles.__setitem__(0, compiles[0] + (event == "/jax/core/compile/backend_compile_duration")))
  sandbox = LocalSandbox(root_dir=sandbox_root)
  # 8 slots, as the exception test below: its programs are then this run's (the compile cache).
  c = tiny_config(tokenizer_dir, **{"train.num_updates": 4, "controller.mode": "async",
                                    "controller.max_staleness": 1, "train.plot": True,
                                    "rollout.num_slots": 8,
                                    # the summary names tasks kept with unsafe verdicts (none here)
                                    "env.allow_unsafe_verdicts": True})
  summary = Trainer(c, str(tmp_path / "run"), sandbox=sandbox,
                    on_update=lambda r: at_update.append(compiles[0]), log=lambda s: None).run()
  assert summary["version"] == 4
  # Updates 2..4 reuse every compiled program (engine steps, noisers, ES update, checkpointing).
  assert at_update[1] == at_update[2] == at_update[3], at_update
  records = metrics.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  train = [r for r in records if "train" in r]
  assert [r["version"] for r in train] == [1, 2, 3, 4]
  for r in train:
    assert sum(r["staleness_hist"]) == r["num_results"] and r["num_results"] <= 4
    assert 0 <= r["slot_utilisation"] <= 1 and r["train"]["episodes"] >= 0
    assert set(r["time"]) >= {"generate_s", "env_wait_s", "update_s"}
    assert 0 <= r["pairs"]["tied"] <= r["pairs"]["complete"] <= 2
  evals = [r for r in records if "eval" in r]
  assert [r["version"] for r in evals] == [0, 4]
  assert os.path.getsize(tmp_path / "run" / "progress.png") > 0
  assert json.load(open(tmp_path / "run" / "summary.json"))["version"] == 4
  assert summary["unsafe_verdicts"] == []
  assert os.listdir(sandbox_root) == []


def test_resume_equals_uninterrupted(tokenizer_dir, warm_start, tmp_path):
  # Both runs start from the module's warm start; the resumed update moves θ (asserted). With the
  # L2 anchor toward version 0 (the resume reads θ₀ from checkpoint 0) and the drift measures.
  base = {**SYNC, "warmstart.init_from": warm_start, "controller.episodes_per_member": 2,
          "train.transcripts_per_update": 8,   # every episode's transcript (_first_divergence)
          "es.anchor": "l2", "es.anchor_decay": 10.0, "eval.num_tasks": 2, "eval.drift": True,
          "eval.kl_transcripts": 2, "eval.probe_families": "find_files", "eval.probe_tasks": 1,
          "eval.mc_probe_file": "bundled"}
  quiet = dict(log=lambda s: None)
  whole = Trainer(tiny_config(tokenizer_dir, **{**base, "train.num_updates": 3}), str(tmp_path / "a"), **quiet).run()
  norms = [r["update_norm"] for r in metrics.read_metrics(str(tmp_path / "a" / "metrics.jsonl")) if "train" in r]
  assert norms[2] > 0, f"the update after the resume point did not move θ ({norms}): vacuous comparison"
  Trainer(tiny_config(tokenizer_dir, **{**base, "train.num_updates": 2}), str(tmp_path / "b"), **quiet).run()
  said = []
  resumed = Trainer(tiny_config(tokenizer_dir, **{**base, "train.num_updates": 3}), str(tmp_path / "b"),
                    log=said.append).run()
  # From the full checkpoint the first run ended with, not through the update log.
  assert "resumed from checkpoint at version 2" in said, said
  assert resumed["version"] == whole["version"] == 3 and resumed["updates_this_run"] == 1
  assert _first_divergence(tmp_path / "a", tmp_path / "b") is None, _first_divergence(tmp_path / "a", tmp_path / "b")
  _params_equal(resumed["params"], whole["params"])
  versions = [r["version"] for r in metrics.read_metrics(str(tmp_path / "b" / "metrics.jsonl")) if "train" in r]
  assert versions == [1, 2, 3]
  _check_drift_and_replay(tmp_path / "a", whole["params"])
  probes = [{r["version"]: r["eval"]["mc_probe"] for r in metrics.read_metrics(str(w / "metrics.jsonl"))
             if "eval" in r} for w in (tmp_path / "a", tmp_path / "b")]
  # The resumed run (evaluated at 0, 2 and 3) scores versions 0 and 3 as the uninterrupted one.
  assert sorted(probes[1]) == [0, 2, 3] and all(probes[0][v] == probes[1][v] for v in (0, 3))


def _check_drift_and_replay(workdir, final_params):
  """The drift measures of an anchored run: 0 / 0 / the probe at version 0, ``param_drift`` as
  numpy computes it on the checkpointed parameters, the multiple-choice probe of the checkpointed
  versions at each evaluation; and the update log replayed from version 0
  with θ₀ reproduces the run's parameters bit for bit."""
  from jaxes.run_tools import probe
  from jaxes.train import drift, mc_probe
  from jaxes.train.algorithms import evolution
  from jaxes.train.policy import load_policy
  from jaxes.train.update_log import UpdateLog
  evals = [r["eval"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "eval" in r]
  assert [e["version"] for e in evals] == [0, 3]
  assert evals[0]["param_drift"] == 0 and evals[0]["kl_to_initial"] == 0
  assert evals[0]["probe"]["episodes"] == 1 and "success" in evals[0]["probe"]
  assert os.path.exists(workdir / drift.KL_TRANSCRIPTS) and evals[1]["kl_to_initial"] >= 0
  start, end = load_policy(str(workdir), 0), load_policy(str(workdir), 3)
  # The multiple-choice probe at every evaluation: the checkpointed versions' scores, as the run
  # tool scores them afterwards (into mc_probe.json).
  scored = probe.probe_run(str(workdir), ["0", "last"], mc_probe.bundled_path(), log=lambda s: None)
  assert sorted(scored) == [0, 3]
  for e in evals:
    assert e["mc_probe"] == pytest.approx(scored[e["version"]], rel=1e-6)
  assert json.load(open(workdir / probe.OUTPUT))["versions"]["3"] == scored[3]
  assert evals[0]["mc_probe"]["items"] == 32
  diffs = [np.asarray(b, np.float64) - np.asarray(a, np.float64)
           for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(end.params))]
  want = np.sqrt(sum(np.sum(d * d) for d in diffs))
  assert want > 0 and evals[1]["param_drift"] == pytest.approx(want, rel=1e-5)
  groups = evals[1]["param_drift_groups"]   # every leaf of the model is in one group
  assert sum(v * v for v in groups.values()) == pytest.approx(want * want, rel=1e-4)
  strategy = evolution.build_strategy(start.config)
  state = strategy.init(start.params, jax.random.key(start.config.seed))
  for record in UpdateLog(str(workdir / "update_log")).records():
    state = strategy.update(state, [tuple(r) for r in record["results"]], start.params)[0]
  assert int(state.version) == 3
  _params_equal(state.params, final_params)


@pytest.mark.end_to_end
def test_sigkill_at_random_moments_then_rerun_equals_uninterrupted(tokenizer_dir, warm_start, tmp_path):
  """`python -m jaxes.train` SIGKILLed twice at random moments during training (mid-rollout,
  mid-update or mid-checkpoint), then the same command again: the same parameters as a run
  never interrupted, every version's metrics line once, no episode directory left behind."""
  # SYNC's 60 warm-start steps: members then solve different tasks, so theta moves (update 2;
  # with 40 every fitness was 0 and the parameter check below compared two unmoved runs).
  base = {**SYNC,
          "train.num_updates": 5, "train.plot": False,   # two kills near updates 1-3, two ahead
          "train.checkpoint_every": 3}   # kills between full checkpoints resume through the update log
  # Both from the module's warm start (see warm_start).
  config = tiny_config(tokenizer_dir, **{**base, "warmstart.init_from": warm_start})
  whole = Trainer(config, str(tmp_path / "a"), log=lambda s: None).run()
  norms = [r["update_norm"] for r in metrics.read_metrics(str(tmp_path / "a" / "metrics.jsonl")) if "train" in r]
  assert max(norms) > 0, f"theta never moved: the resumed-parameters check would be vacuous ({norms})"
  config_file = write_config_file(config, tmp_path / "sigkill_config.py")
  workdir = tmp_path / "b"
  cmd = [sys.executable, "-m", "jaxes.train", f"--config={config_file}", f"--workdir={workdir}"]
  rng, killed = random.Random(0), []
  for _ in range(2):
    target = len(train_records(workdir)) + 1
    killed.append(kill_when(cmd, lambda: len(train_records(workdir)) >= target,
                            tmp_path / "sigkill.stderr",
                            delay=rng.uniform(0.0, 0.5)))  # short: later updates must still be ahead
  assert 1 <= len(train_records(workdir)) < 5
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resumed from checkpoint" in done.stdout + done.stderr
  resumed = Trainer(config, str(workdir), log=lambda s: None).run()  # already done: restores
  assert resumed["version"] == 5 and resumed["updates_this_run"] == 0
  _params_equal(resumed["params"], whole["params"])
  versions = [r["version"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert versions == list(range(1, 6))
  parent = local_sandbox._default_parent() or tempfile.gettempdir()
  assert not [n for n in os.listdir(parent) if any(n.startswith(f"jaxes-local-{pid}-") for pid in killed)]


def test_exception_inside_loop_leaves_no_sandbox(tokenizer_dir, tmp_path, sandbox_root):
  sandbox = LocalSandbox(root_dir=sandbox_root)

  def explode(record):
    raise RuntimeError("boom at update %d" % record["version"])

  c = tiny_config(tokenizer_dir, **{"controller.mode": "async", "controller.max_staleness": 1,
                                    "rollout.num_slots": 8,
                                    # the summary names tasks kept with unsafe verdicts (none here)
                                    "env.allow_unsafe_verdicts": True})
  with pytest.raises(RuntimeError, match="boom at update 1"):
    Trainer(c, str(tmp_path / "run"), sandbox=sandbox, on_update=explode, log=lambda s: None).run()
  assert os.listdir(sandbox_root) == []
  assert sandbox.leftovers() == {"directories": 0}


def test_paired_change_uses_per_task_differences():
  from jaxes.train.evaluation import REWARD, format_table, paired_change
  before = {"version": 0, "success": 0.5, "stderr": 0.29, "reward": 0.5, "episodes": 4,
            "per_task": [1.0, 0.0, 1.0, 0.0]}
  after = {**before, "version": 3, "success": 0.75, "per_task": [1.0, 1.0, 1.0, 0.0]}
  change = paired_change(before, after)
  assert change["success"] == 0.25 and change["tasks"] == 4
  assert abs(change["stderr"] - 0.25) < 1e-12  # diffs [0, 1, 0, 0]: sd 0.5 / sqrt(4)
  assert "+0.250 ± 0.250" in format_table(before, after)
  assert paired_change(before, {**after, "per_task": [1.0]}) is None
  assert paired_change({k: v for k, v in before.items() if k != "per_task"}, after) is None
  # the mean reward (WebShop's score) compares the same way, from its own per-task values
  assert paired_change(before, after, REWARD) is None
  before["per_task_reward"], after["per_task_reward"] = [0.5, 0.0, 0.5, 0.0], [0.5, 0.5, 0.5, 0.0]
  assert paired_change(before, after, REWARD) == {"reward": 0.125, "stderr": 0.125, "tasks": 4}
  assert "reward change (paired s.e.)" in format_table(before, after)


def test_off_protocol_transcripts_fail_to_parse_and_keep_the_rest():
  from jaxes.envs import protocol
  transcripts = [[{"role": "system", "content": "s"}, {"role": "user", "content": f"task {i}"},
                  {"role": "assistant", "content": f"<command>echo {i} > out.txt</command>"},
                  {"role": "user", "content": "ok"},
                  {"role": "assistant", "content": "<action>done</action>"}] for i in range(200)]
  out = oracle.off_protocol(transcripts, 0.5, seed=3)
  assert out == oracle.off_protocol(transcripts, 0.5, seed=3)  # deterministic from the seed
  fenced = [i for i, m in enumerate(out) if m[2]["content"] != transcripts[i][2]["content"]]
  assert 70 < len(fenced) < 130
  for i in fenced:
    assert out[i][2]["content"] == f"```bash\necho {i} > out.txt\n```"
    assert protocol.parse_action(out[i][2]["content"]).kind == "invalid"
    assert out[i][:2] + out[i][3:] == transcripts[i][:2] + transcripts[i][3:]
  assert transcripts[fenced[0]][2]["content"].startswith("<command>")  # input not mutated
  assert oracle.off_protocol(transcripts, 0.0, seed=3) == transcripts


def test_pair_ties_counts_complete_antithetic_pairs_and_their_ties():
  # Members 2k and 2k+1 of one version are partners; version 1's member 4 has no partner yet.
  results = [(0, 0, 1.0), (0, 1, 1.0), (0, 2, 0.5), (0, 3, 0.0), (1, 4, 0.2), (1, 1, 0.2)]
  assert pair_ties(results) == {"complete": 2, "tied": 1}

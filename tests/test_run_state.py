"""Run state through the trainer: a rerun with a changed config stops before any compute and
touches nothing, a corrupt newest checkpoint is skipped with a warning, a run never silently
starts over, --restart sets a run aside, load_policy and the Hugging Face export round-trip, and
the update log's replay equals an uninterrupted run. One finished run serves every test (copied
where a test changes it), and is the uninterrupted run the replay is compared with."""
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_train import ROOT, build_tiny_tokenizer, tiny_config, write_config_file
from jaxes.models import check_logits, qwen2
from jaxes.run_tools import compare, export, report
from jaxes.train import metrics
from jaxes.train.policy import PolicyLoadError, load_policy
from jaxes.train.state import RunStateError
from jaxes.train.trainer import Trainer
from jaxes.train.update_log import UpdateLog, encode

QUIET = dict(log=lambda s: None, write_report=report.write)
# tests/test_train.py's resume config (its programs, in the compile cache): after the short warm
# start members differ in reward, so updates 1 and 3 move θ and the comparisons of a resumed run
# with the uninterrupted one can fail (without it every reward was 0 and every update a zero step).
BASE = {"controller.mode": "sync", "controller.max_staleness": 0, "eval.num_tasks": 0,
        "env.partial_credit": True, "rollout.temperature": 0.4,
        "rollout.common_random_numbers": False, "train.plot": False, "warmstart.steps": 60,
        "warmstart.learning_rate": 1e-2, "controller.episodes_per_member": 2, "rollout.num_slots": 8}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def finished_run(tokenizer_dir, tmp_path_factory):
  """A 3-update run (checkpoints at versions 0, 1, 2, 3), never modified by the tests."""
  workdir = tmp_path_factory.mktemp("runs") / "done"
  config = tiny_config(tokenizer_dir, **{**BASE, "train.num_updates": 3})
  summary = Trainer(config, str(workdir), **QUIET).run()
  return workdir, config, summary


def _tree_digest(root) -> str:
  digest = hashlib.sha256()
  for path in sorted(pathlib.Path(root).rglob("*")):
    digest.update(str(path.relative_to(root)).encode())
    if path.is_file():
      digest.update(path.read_bytes())
  return digest.hexdigest()


def _copy_run(src, dst):
  subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
  return dst


def _update_norms(workdir):
  return [r["update_norm"] for r in metrics.read_metrics(str(pathlib.Path(workdir) / "metrics.jsonl"))
          if "train" in r]


def _params_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _train(config_file, workdir, *extra):
  cmd = [sys.executable, "-m", "jaxes.train", f"--config={config_file}", f"--workdir={workdir}", *extra]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_rerun_with_changed_config_is_one_line_and_touches_nothing(finished_run, tmp_path):
  src, config, _ = finished_run
  workdir = _copy_run(src, tmp_path / "run")
  before = _tree_digest(workdir)
  changed = tiny_config(config.tokenizer.path, **{**BASE, "train.num_updates": 3, "model.intermediate_size": 96})
  # Allowed, the change still cannot restore these shapes: the checkpoint names the leaf.
  done = _train(write_config_file(changed, tmp_path / "changed.py"), workdir, "--allow_config_change")
  assert done.returncode == 2, done.stderr[-2000:]
  # One line of ours (libtpu, when installed, may print its own warnings first), no traceback.
  message = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(message) == 1 and "Traceback" not in done.stderr, done.stderr
  assert done.stderr.strip().splitlines()[-1] == message[0]
  assert "config.model.intermediate_size was 64 there, is 96 here" in message[0]
  assert re.search(r"leaf 'params/layers/mlp/\w+/kernel/value' is stored as float32\[1, (64, 32|32, 64)\], "
                   r"this run expects float32\[1, (96, 32|32, 96)\]", message[0]), message[0]
  assert "--restart" in message[0]
  assert _tree_digest(workdir) == before
  # The reverted config resumes: nothing was moved, and the run is already done.
  again = Trainer(config, str(workdir), **QUIET).run()
  assert again["version"] == 3 and again["updates_this_run"] == 0
  assert before.split() and _tree_digest(workdir / "checkpoints") == _tree_digest(src / "checkpoints")


def _array_files(step_dir):
  files = [p for p in pathlib.Path(step_dir).rglob("*") if p.is_file() and p.stat().st_size > 256
           and "meta" not in str(p.relative_to(step_dir)).split(os.sep)[0]]
  assert files, f"no array files under {step_dir}"
  return files


def _flip(path, offset=128, count=64):
  data = bytearray(path.read_bytes())
  for i in range(offset, min(offset + count, len(data))):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def test_corrupt_newest_checkpoint_warns_falls_back_and_resumes_exactly(finished_run, tmp_path):
  src, config, whole = finished_run
  workdir = _copy_run(src, tmp_path / "run")
  files = _array_files(workdir / "checkpoints" / "3")
  for f in files:
    _flip(f)
  # Before the rerun a reader falls back to version 2, and compare will not call it version 3.
  compared = []
  with pytest.warns(RuntimeWarning, match="checkpoint step 3 .* corrupt"):
    assert not compare.compare(str(workdir), str(src), log=compared.append)
  assert compared[-1] == (f"parameters: NOT of the versions named above: {workdir} loaded version 2, "
                          f"its newest checkpoint is 3 (unreadable; a rerun of the run sets it aside "
                          f"and writes it again)")
  said = []
  with pytest.warns(RuntimeWarning, match="checkpoint step 3 .* corrupt"):
    resumed = Trainer(config, str(workdir), log=said.append).run()
  # Step 2 restores, and update 3 is replayed from the update log: the same state as before.
  assert _update_norms(src)[2] > 0, "update 3 did not move θ: vacuous comparison"
  assert "resumed from checkpoint at version 2 and 1 logged updates" in said
  assert resumed["version"] == 3 and resumed["updates_this_run"] == 0
  _params_equal(resumed["params"], whole["params"])
  versions = [r["version"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert versions == [1, 2, 3]
  # The corrupt step is set aside and version 3 written again: every reader names version 3.
  assert any("moved to" in line and "version 3, replayed from the update log, written again" in line
             for line in said), said
  assert (workdir / "checkpoints_superseded" / "3").is_dir()
  policy = load_policy(str(workdir))   # no warning: step 3 reads back
  assert policy.version == 3 == json.loads((workdir / "summary.json").read_text())["version"]
  _params_equal(policy.params, whole["params"])
  compared.clear()
  assert compare.compare(str(workdir), str(src), log=compared.append), compared
  assert compared[-1].startswith("parameters of version 3: all ")


def test_no_restorable_checkpoint_stops_instead_of_starting_over(finished_run, tmp_path):
  src, config, _ = finished_run
  workdir = _copy_run(src, tmp_path / "run")
  for step in (0, 1, 2, 3):
    for f in _array_files(workdir / "checkpoints" / str(step)):
      _flip(f)
  lines_before = (workdir / "metrics.jsonl").read_text()
  with pytest.warns(RuntimeWarning), pytest.raises(RunStateError, match="--restart"):
    Trainer(config, str(workdir), **QUIET).run()
  assert (workdir / "metrics.jsonl").read_text() == lines_before
  done = _train(write_config_file(config, tmp_path / "c.py"), workdir)
  assert done.returncode == 2 and "--restart" in done.stderr.strip().splitlines()[-1]
  # The fresh run starts from the same version 0 (the finished run's, warmstart.init_from, rather
  # than making the same warm start again) and trains one update: it repeats the finished run's
  # update 1 exactly. The set-aside run's files leave with it, so its config binds nothing.
  before = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
  assert {"episodes.jsonl", "report.html", "metrics.jsonl", "summary.json"} <= set(before)
  restarted = _train(write_config_file(config, tmp_path / "c.py"), workdir, "--restart",
                     "--config.train.num_updates=1", f"--config.warmstart.init_from={src}")
  assert restarted.returncode == 0, restarted.stderr[-2000:]
  aside = [p for p in workdir.iterdir() if p.name.startswith("restarted-")]
  assert len(aside) == 1 and (aside[0] / "checkpoints" / "3").is_dir()
  # Every file of the old run moved aside, none left behind for the new run to overwrite.
  assert sorted(str(p.relative_to(aside[0])) for p in aside[0].rglob("*")) == before
  assert (aside[0] / "metrics.jsonl").read_text() == lines_before
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0, 1]
  assert [r["version"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r] == [1]
  assert _update_norms(src)[0] > 0   # update 1 moves θ: the equality below says which version 1
  _params_equal(load_policy(str(workdir)).params, load_policy(str(src), version=1).params)


def test_load_policy_round_trip_and_clear_errors(finished_run, tmp_path):
  src, config, whole = finished_run
  policy = load_policy(str(src))
  assert policy.version == 3 and policy.model_config.intermediate_size == 64
  _params_equal(policy.params, whole["params"])
  assert policy.config.model.intermediate_size == 64
  first = load_policy(str(src), version=0)
  assert first.version == 0
  with pytest.raises(PolicyLoadError, match="checkpointed versions: \\[0, 1, 2, 3\\]"):
    load_policy(str(src), version=7)
  with pytest.raises(PolicyLoadError, match="not a run directory"):
    load_policy(str(tmp_path))


def test_export_loads_in_transformers_with_the_same_logits(finished_run, tmp_path):
  torch = pytest.importorskip("torch")
  import transformers
  src, _, _ = finished_run
  out = tmp_path / "hf"
  assert export.export(str(src), str(out)) == 3
  policy = load_policy(str(src))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  ids = tok("ls -la | grep log", add_special_tokens=False)["input_ids"]
  assert ids == policy.tokenizer.encode("ls -la | grep log", add_special_tokens=False)
  with torch.no_grad():
    want = hf_model(torch.tensor([ids])).logits[0].numpy()
  tokens = jnp.asarray([ids], jnp.int32)
  positions = jnp.arange(len(ids))[None]
  got, _ = qwen2.forward(policy.graphdef, policy.params, tokens, positions, jnp.ones_like(tokens, bool))
  np.testing.assert_allclose(np.asarray(got[0]), want, atol=1e-4, rtol=1e-4)
  # jaxes' own Hugging Face loader reads the export to the same logits (check_logits' comparison,
  # in this process: tests/test_model_check_logits.py runs its command line).
  assert check_logits.main(["--hf_dir", str(out)]) == 0


def test_update_log_replay_equals_uninterrupted(finished_run, tmp_path):
  """Full checkpoints every 3 updates, an update-log record every update: a crash after update 2
  (its metrics line lost, a torn record after it) resumes from version 0 plus two replayed
  updates, trains update 3 and ends with the parameters of a run never interrupted (finished_run:
  the same config, checkpointed every update, which does not change what it trains)."""
  _, whole_config, whole = finished_run
  # It starts from the finished run's version 0 (warmstart.init_from) rather than making the same
  # warm start again.
  config = tiny_config(whole_config.tokenizer.path, **{**BASE, "train.num_updates": 3,
                                                       "train.checkpoint_every": 3,
                                                       "warmstart.init_from": str(finished_run[0])})
  norms = _update_norms(finished_run[0])
  assert norms[0] > 0 and norms[2] > 0, f"a replayed and the trained update move θ, else vacuous ({norms})"

  def crash(record):
    if record["version"] == 2:
      raise RuntimeError("killed after update 2")

  workdir = tmp_path / "b"
  with pytest.raises(RuntimeError, match="killed after update 2"):
    Trainer(config, str(workdir), on_update=crash, **QUIET).run()
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [0]
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  (workdir / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")   # update 2's line lost
  with open(workdir / "update_log", "ab") as f:
    f.write(encode({"version": 3, "results": []})[:20])                  # a torn record
  with pytest.warns(RuntimeWarning, match="torn"):
    resumed = Trainer(config, str(workdir), **QUIET).run()
  assert resumed["updates_this_run"] == 1
  _params_equal(resumed["params"], whole["params"])
  versions = [r["version"] for r in metrics.read_metrics(str(workdir / "metrics.jsonl")) if "train" in r]
  assert versions == [1, 2, 3]
  assert [r["version"] for r in UpdateLog(str(workdir / "update_log")).records()] == [1, 2, 3]


def test_a_run_starts_from_an_exported_checkpoint_whose_shape_the_config_cannot_override(finished_run, tmp_path):
  """docs/training.md's offline recipe (configs/demo.py:checkpoint, model.path) on an exported
  tiny checkpoint: a size set beside model.path that differs from the checkpoint's is one line
  naming both; left at 0 the run says which model it loaded and starts from its weights."""
  from jaxes.train.config import ConfigError, load_config_file, validate
  src, config, whole = finished_run
  out = tmp_path / "hf"
  export.main([f"--workdir={src}", f"--out={out}"])
  recipe = load_config_file(ROOT / "configs" / "demo.py", "checkpoint")
  for section in ("env", "rollout", "es", "controller", "train", "eval", "mesh"):   # tiny sizes
    recipe[section] = config[section]
  recipe.model.path = str(out)
  recipe.model.hidden_size = 64
  with pytest.raises(ConfigError, match=rf"^config.model.hidden_size: 64, but the checkpoint "
                                        rf"config.model.path={out} has hidden_size 32: "):
    validate(recipe)
  recipe.model.hidden_size = 0
  recipe.train.num_updates, recipe.eval.num_tasks = 0, 0
  said = []
  Trainer(recipe, str(tmp_path / "run"), log=said.append).run()
  assert f"model: config.model.path={out} (Qwen2, 1 layers, hidden 32, intermediate 64, heads 2/1, " \
         f"vocab 400, float32)" in said, said
  _params_equal(load_policy(str(tmp_path / "run"), 0).params, whole["params"])


def test_a_llama_gguf_trains_reloads_and_exports_as_llama(tokenizer_dir, tmp_path):
  """A Llama-family model from a GGUF file (no attention biases) through the trainer: version 0 is
  the file's weights, an ES update runs, load_policy reads the run back (no bias leaves) and the
  export is a LlamaForCausalLM that transformers computes the same logits with."""
  import transformers
  from helpers_models import save_random_hf_checkpoint, write_gguf
  from jaxes.models import sources
  cfg = qwen2.Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
                          architecture="LlamaForCausalLM", attention_bias=False)
  path = str(tmp_path / "llama.gguf")
  write_gguf(path, save_random_hf_checkpoint(str(tmp_path / "src"), cfg, seed=9), cfg)
  config = tiny_config(tokenizer_dir, **{**BASE, "warmstart.steps": 0, "train.num_updates": 1})
  config.model.path = path
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
    config.model[key] = 0
  workdir = tmp_path / "run"
  summary = Trainer(config, str(workdir), **QUIET).run()
  _params_equal(load_policy(str(workdir), 0).params, sources.load(path)[2])
  policy = load_policy(str(workdir))
  assert policy.version == 1 and policy.model_config == cfg
  assert not [p for p in jax.tree_util.tree_leaves_with_path(policy.params) if "bias" in str(p[0])]
  _params_equal(policy.params, summary["params"])
  out = tmp_path / "hf"
  export.export(str(workdir), str(out))
  assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
  exported = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
  ids = policy.tokenizer.encode("ls -la | grep log", add_special_tokens=False)
  got, _ = qwen2.forward(policy.graphdef, policy.params, jnp.asarray([ids], jnp.int32),
                         jnp.arange(len(ids))[None], jnp.ones((1, len(ids)), bool))
  import torch
  with torch.no_grad():
    want = exported(torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(np.asarray(got[0]), want, atol=1e-4, rtol=1e-4)

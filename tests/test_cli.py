"""The command lines behave alike (issue 57): --help exits 0 and leads to the config keys, a bad
input is one line with exit status 2 (1 only for "does not fit"), a moved key gets a "did you
mean", nothing overwrites another command's files, and a CPU machine with the accelerator
plugins installed starts quietly on the CPU."""
import json
import os
import subprocess
import sys

import pytest

from helpers_train import ROOT
from jaxes import cli, preflight
from jaxes.errors import ConfigError
from jaxes.run_tools import export
from jaxes.train import defaults, run_dir
from jaxes.train.config import load_config_file


def _run(*args, env=None):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=env)


@pytest.mark.end_to_end
def test_train_help_exits_0_and_config_help_lists_every_key_with_its_default():
  done = _run("-m", "jaxes.train", "--help")
  assert done.returncode == 0 and "--config_help" in done.stdout.splitlines()[-1], done.stderr
  keys = _run("-m", "jaxes.train", "--config_help")
  assert keys.returncode == 0 and keys.stderr == ""
  assert "  es.population = 32" in keys.stdout and "  env.sandbox = 'local'" in keys.stdout
  assert len(keys.stdout.splitlines()) == 1 + len(defaults.flat_keys())


@pytest.mark.end_to_end
def test_unknown_key_is_one_line_with_where_it_moved():
  done = _run("-m", "jaxes.train", "--config=configs/demo.py", "--workdir=unused",
              "--config.env.backend=docker")
  assert done.returncode == 2 and done.stderr.splitlines() == [
      "error: config.env.backend: unknown key (did you mean 'config.env.sandbox'?)"]
  assert defaults.did_you_mean("es.sigmaa") == " (did you mean 'es.sigma'?)"   # a close spelling
  assert defaults.did_you_mean("rollout.population") == " (did you mean 'es.population'?)"   # another section
  assert defaults.did_you_mean("config.zzz.qqq") == ""


@pytest.mark.end_to_end
def test_a_workdir_holding_an_exported_model_is_refused_in_one_line_without_jax_platforms(tmp_path):
  """No JAX_PLATFORMS: jaxes sets the CPU itself (no accelerator here) and the CUDA and TPU
  plugins, where installed, add nothing to the one line."""
  if cli.accelerator_present():
    pytest.skip("an accelerator is present: JAX may start its plugin")
  (tmp_path / "hf").mkdir()
  hf_config = json.dumps({"model_type": "qwen2", "hidden_size": 32})
  (tmp_path / "hf" / "config.json").write_text(hf_config)
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  done = _run("-m", "jaxes.train", "--config=configs/demo.py", f"--workdir={tmp_path / 'hf'}", env=env)
  assert done.returncode == 2 and done.stderr.splitlines() == [
      f"error: --workdir={tmp_path / 'hf'}: its config.json was not written by python -m jaxes.train "
      f"(a Hugging Face model's); nothing was written. Use another --workdir, or --restart to move "
      f"what is there aside"], done.stderr
  assert (tmp_path / "hf" / "config.json").read_text() == hf_config


@pytest.mark.end_to_end
def test_a_command_that_imports_jax_at_module_level_starts_quietly():
  """The grid (like compare, report, fastlane and measure) loads JAX while its module is imported,
  before main runs: its start must be quiet too."""
  if cli.accelerator_present():
    pytest.skip("an accelerator is present: JAX may start its plugin")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  done = _run("-m", "jaxes.experiments.grid", "--help", env=env)
  assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_platform_is_set_only_where_no_accelerator_and_no_choice_is():
  environ = {}
  assert cli.set_up_platform(environ, accelerator=False).startswith("platform: cpu")
  assert environ == {"JAX_PLATFORMS": "cpu"}
  assert cli.set_up_platform({}, accelerator=True) is None
  chosen = {"JAX_PLATFORMS": "cuda"}
  assert cli.set_up_platform(chosen, accelerator=False) is None and chosen == {"JAX_PLATFORMS": "cuda"}
  assert cli.PLUGIN_NOISE.search("I0000 00:00:1796528705.092235   23865 cudart_stub.cc:31] Could not "
                                 "find cuda drivers on your machine, GPU will not be used.")


def test_run_directory_checks(tmp_path):
  (tmp_path / "run").mkdir()
  assert run_dir.foreign_config(str(tmp_path / "run")) is None   # nothing there yet
  (tmp_path / "run" / "config.json").write_text(json.dumps(defaults.base_config().to_dict()))
  assert run_dir.foreign_config(str(tmp_path / "run")) is None   # a run's own
  (tmp_path / "run" / "config.json").write_text("{")
  assert "cannot be read" in run_dir.foreign_config(str(tmp_path / "run"))
  assert run_dir.unwritable(str(tmp_path / "run")) is None
  assert run_dir.unwritable("/proc/1") is not None   # not writable, even by root
  assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".jaxes")]


def test_export_refuses_a_run_directory_and_existing_files_and_its_help_is_whole(tmp_path, capsys):
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  (tmp_path / "old").mkdir()
  (tmp_path / "old" / "model.safetensors").write_text("x")
  for out, why in ((run, "is inside the run directory"), (run / "hf", "is inside the run directory"),
                   (tmp_path / "old", "already holds files; pass --overwrite")):
    with pytest.raises(SystemExit) as exit_:
      export.main([f"--workdir={run}", f"--out={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("export: ") and why in err[0], err
  assert (run / "config.json").read_text() == "{}" and not (run / "hf").exists()
  with pytest.raises(SystemExit) as exit_:
    export.main(["--help"])
  out = capsys.readouterr().out
  assert exit_.value.code == 0 and "loads\nas ``Qwen2ForCausalLM``" in out and "--overwrite" in out


def test_preflight_names_a_mesh_the_slots_do_not_divide_and_says_when_it_is_partial():
  config = load_config_file(os.path.join(ROOT, "configs", "demo.py"))
  with pytest.raises(ConfigError, match=r"^config.rollout.num_slots: 32 is not divisible by the mesh's "
                                        r"data=7 on 7xH100"):
    preflight.check_mesh(config, preflight.named_device_count("7xH100"), "7xH100")
  program = dict(name="step", required=0, arguments=1, temporaries=1, outputs=1, aliased=0, seconds=1.0)
  report = dict(device_memory_bytes=2**30, peak_bytes_per_device=2**20, estimate=False, compiler="cpu",
                algorithm="es", topology="cpu:1", devices=1, device_kind="cpu", mesh={}, live_versions=1,
                per_device={"parameters": 2**20}, peak_program="step", programs=[program], only="step")
  lines, fits = preflight.render(report, 0.9)
  assert fits and lines[-1].startswith("fits, as far as compiled: ") and "partial" in lines[-1]
  assert preflight.summary(report, fits)["partial"] is True
  lines, _ = preflight.render({**report, "only": None}, 0.9)
  assert lines[-1].startswith("fits: peak")


@pytest.mark.end_to_end
def test_perturb_update_without_evosax_is_one_line_naming_the_extra():
  done = _run("-c", "import runpy, sys; sys.modules['evosax'] = None; "
                    "sys.argv = ['perturb_update.py', '--dim', '8']; "
                    "runpy.run_path('benchmarks/perturb_update.py', run_name='__main__')")
  assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
      "perturb_update: evosax is not installed: pip install -e '.[bench]' (or --no-evosax to leave "
      "its row out)"), done.stderr

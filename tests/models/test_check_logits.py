"""check_logits: the CLI on a random checkpoint with its own tokenizer, and its pass/fail rule."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxes import tokenization
from jaxes.models import check_logits, qwen2
from helpers_models import TOKENIZER_CORPUS, save_random_hf_checkpoint
import helpers_repo

REPO = str(helpers_repo.REPO)


@pytest.mark.end_to_end
def test_cli_passes_on_a_random_checkpoint_on_an_8_device_mesh(tmp_path):
  cfg = qwen2.Qwen2Config(vocab_size=300, hidden_size=48, intermediate_size=100, num_layers=2,
                          num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
  save_random_hf_checkpoint(str(tmp_path), cfg, seed=7)
  tokenization.build_tokenizer(TOKENIZER_CORPUS, 300, str(tmp_path))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  env.pop("XLA_FLAGS", None)  # the CLI itself asks for as many CPU devices as the mesh needs
  proc = subprocess.run(
    [sys.executable, "-m", "jaxes.models.check_logits", "--hf_dir", str(tmp_path),
     "--mesh", "data=2,fsdp=2,tensor=2", "--prompt", "ls -la | grep py"],
    env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert "8 device(s)" in proc.stdout
  metrics = json.loads(lines[-1])
  assert metrics["max_abs_diff"] <= 1e-4 and metrics["top1_agreement"] == 1.0


def test_cli_reports_an_unusable_checkpoint_in_one_line(tmp_path):
  assert check_logits.main(["--hf_dir", str(tmp_path / "missing")]) == 2


def test_tolerance_rule():
  rng = np.random.RandomState(0)
  reference = rng.normal(size=(5, 40)).astype(np.float32)
  same = check_logits.compare(reference, reference + 1e-6)
  assert check_logits.within_tolerance(same, "float32")
  off = check_logits.compare(reference, reference + rng.normal(scale=1e-3, size=reference.shape))
  assert off["max_abs_diff"] > 1e-4 and not check_logits.within_tolerance(off, "float32")
  assert check_logits.within_tolerance(off, "bfloat16")
  shuffled = check_logits.compare(reference, reference[:, ::-1])
  assert shuffled["top1_agreement"] < 0.9 and not check_logits.within_tolerance(shuffled, "bfloat16")

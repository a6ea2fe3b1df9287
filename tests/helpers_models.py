"""Tiny random Qwen2/Llama checkpoints and tokenizers built locally, for tests (no hub, no network)."""
from __future__ import annotations

import os

import numpy as np

from jaxes.models.qwen2 import Qwen2Config

TOKENIZER_CORPUS = [
  "ls -la /home/user && cat notes.txt | grep -n error",
  "The quick brown fox jumps over the lazy dog. 0123456789",
  "<command>echo 'hello world' > out.txt</command> <action>done</action>",
  "def main():\n    print('héllo, wörld ✓')\n",
  "mkdir -p data/logs; find . -name '*.py' -exec wc -l {} +",
]


def tiny_model(preset: str = "tiny-gqa", seed: int = 0, **overrides):
  """``(cfg, graphdef, params)`` of a randomly initialised tiny Qwen2."""
  from flax import nnx
  from jaxes.models.qwen2 import Qwen2ForCausalLM

  cfg = Qwen2Config.preset(preset, **overrides)
  return (cfg, *nnx.split(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param))


def es_bank(strategy, run_key, **kw):
  """An engine's policy bank for ``strategy``'s members under ``run_key`` (``kw``:
  ``version_steps``, ``member_slices``); None without a strategy (the plain bank)."""
  from jaxes.rollout.policy_bank import ESPolicyBank
  return None if strategy is None else ESPolicyBank(strategy.engine_noiser(run_key), **kw)


def assert_same_turns(got: dict, want: dict, atol: float = 1e-4) -> None:
  """Two engines' turns per slot (``{slot: [(tokens, log-probs), ...]}``): the same tokens, the
  log-probs within ``atol``, and some sampled (nonzero) log-probs, so the comparison is not of
  greedy rows alone."""
  assert {s: [t for t, _ in turns] for s, turns in got.items()} == \
         {s: [t for t, _ in turns] for s, turns in want.items()}
  for slot in got:
    for (_, lp_got), (_, lp_want) in zip(got[slot], want[slot]):
      np.testing.assert_allclose(lp_got, lp_want, atol=atol)
  assert any(lp != 0 for turns in got.values() for _, lps in turns for lp in lps)


def ragged_turns(engine, params_by_version: dict, versions, *, turns: int = 2,
                 observation_growth: int = 1) -> dict:
  """Drive ``engine`` through a ragged schedule: slot i starts an episode of ``versions[i]`` (member
  and stream i; odd slots greedy, even ones sampled) with a random prompt of 2-13 tokens, and
  answers each of its turns but the last after ``1 + i % 3`` steps with an observation of ``1 +
  observation_growth * i`` tokens, so parked slots come back at different steps. An observation
  is drawn from (slot, turn), not from the step, so the inputs stay the same when an engine runs a
  turn at another step (a held prefill). Every turn's ``(tokens, log-probs)`` per slot; a turn
  that ends with a failure is an error."""
  rng = np.random.default_rng(5)
  for slot, version in enumerate(versions):
    prompt = list(rng.integers(4, 64, size=int(rng.integers(2, 14))))
    assert engine.scheduler.start(slot, prompt, version=version, member=slot, stream=slot,
                        temperature=0.0 if slot % 2 else 0.9, top_p=0.95)
  out = {slot: [] for slot in range(len(versions))}
  waiting, step = {}, 0
  while engine.scheduler.busy() or waiting:
    for slot, due in list(waiting.items()):
      if due <= step:
        del waiting[slot]
        size = 1 + observation_growth * slot
        observation = np.random.default_rng(100 * slot + len(out[slot])).integers(4, 64, size=size)
        assert engine.scheduler.continue_turn(slot, list(observation))  # whatever order turns ended in
    for turn in engine.step(params_by_version):
      assert turn.failure is None
      out[turn.slot].append((turn.tokens, turn.logprobs))
      if len(out[turn.slot]) < turns:
        waiting[turn.slot] = step + 1 + turn.slot % 3
    step += 1
  return out


def tiny_tokenizer(out_dir: str, vocab_size: int = 300):
  """A byte-level BPE with Qwen's special tokens and chat template, trained on a fixed corpus."""
  from jaxes import tokenization

  return tokenization.build_tokenizer(TOKENIZER_CORPUS * 4, vocab_size, out_dir)


def save_random_hf_checkpoint(out_dir: str, cfg: Qwen2Config, seed: int = 0,
                              torch_dtype: str = "float32"):
  """A transformers model of ``cfg.architecture`` (Qwen2ForCausalLM, LlamaForCausalLM) with random
  weights — including non-zero biases and norm gains, which HF initialises to 0 and 1 — saved
  with ``save_pretrained``. Returns the model."""
  import torch
  import transformers

  config_class = getattr(transformers, cfg.architecture.replace("ForCausalLM", "Config"))
  hf_cfg = config_class(**cfg.to_hf_dict())
  torch.manual_seed(seed)
  model = getattr(transformers, cfg.architecture)(hf_cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):
        p.normal_(0.0, 0.5)
      elif "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.1)
  model = model.to(getattr(torch, torch_dtype))
  os.makedirs(out_dir, exist_ok=True)
  model.save_pretrained(out_dir)
  return model


def hf_logits(model, tokens, attention_mask=None, position_ids=None):
  """float32 numpy logits of a transformers model for int token arrays [B, T]."""
  import numpy as np
  import torch

  kwargs = {}
  if attention_mask is not None:
    kwargs["attention_mask"] = torch.as_tensor(np.asarray(attention_mask, dtype=np.int64))
  if position_ids is not None:
    kwargs["position_ids"] = torch.as_tensor(np.asarray(position_ids, dtype=np.int64))
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(tokens, dtype=np.int64)), **kwargs)
  return out.logits.float().numpy()

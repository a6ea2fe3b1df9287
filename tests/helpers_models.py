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


def llama_cpp_permute(rows, heads: int):
  """The q/k row order llama.cpp's converter writes for Llama (its ``permute``), from
  transformers' ``rotate_half`` order: within each head, the two halves' rows interleaved."""
  head_size = rows.shape[0] // heads
  return rows.reshape(heads, 2, head_size // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(path: str, model, cfg: Qwen2Config, tensor_type: str = "F32", tokenizer=None,
               **metadata) -> None:
  """A GGUF file as llama.cpp's converter writes one for transformers ``model`` (of ``cfg``):
  its metadata, its tensors under GGUF names (Llama's q/k rows permuted; 2-D weights in
  ``tensor_type``, vectors in float32) and, with ``tokenizer`` (a byte-level BPE), its vocabulary,
  merges and chat template. ``metadata``: ``{key: (value, GGUFValueType)}`` added or replaced."""
  import gguf

  arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[cfg.architecture]
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(cfg.num_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_key_length(cfg.head_size)
  writer.add_rope_dimension_count(cfg.head_size)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_vocab_size(cfg.vocab_size)
  for key, (value, value_type) in metadata.items():
    writer.add_key_value(key, value, value_type)
  names = gguf.get_tensor_name_map(
      next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_layers)
  quant = gguf.GGMLQuantizationType[tensor_type]
  for name, tensor in model.state_dict().items():
    if cfg.tie_word_embeddings and name == "lm_head.weight":
      continue
    data = tensor.float().numpy()
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
      data = llama_cpp_permute(data, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if data.ndim == 2 and quant not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
      writer.add_tensor(gguf_name, gguf.quants.quantize(data, quant), raw_dtype=quant)
    else:
      writer.add_tensor(gguf_name, data.astype(np.float16 if data.ndim == 2 and tensor_type == "F16"
                                               else np.float32))
  if tokenizer is not None:
    import json
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_chat_template(tokenizer.chat_template)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

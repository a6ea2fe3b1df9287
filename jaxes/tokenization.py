"""Tokenizers from local directories, Qwen2.5's ChatML format, and a small BPE builder.

``build_tokenizer`` trains a byte-level BPE (Qwen2's pre-tokenizer split, NFC normalisation) on a
corpus and saves a local HF tokenizer directory with Qwen's special tokens and Qwen2.5's chat
template. ``load_tokenizer`` gives what ``AutoTokenizer`` gives for a real checkpoint's directory and
for this builder's (a test checks the second), without importing torch for the latter.
"""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Iterable, Mapping, Sequence

# torch is optional (tests and check_logits only): without it transformers prints an advisory
# "PyTorch was not found" notice on import that reads as an error; only tokenizers are used here.
if importlib.util.find_spec("torch") is None:
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import transformers  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the stop token of a chat turn
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # in Qwen's id order, after the merged vocabulary
DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, whitespace.
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                       r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2.5-Instruct's chat template (tokenizer_config.json), verbatim in behaviour.
CHAT_TEMPLATE = (
  "{%- if tools %}\n"
  "    {{- '<|im_start|>system\\n' }}\n"
  "    {%- if messages[0]['role'] == 'system' %}\n"
  "        {{- messages[0]['content'] }}\n"
  "    {%- else %}\n"
  "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
  "    {%- endif %}\n"
  "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
  "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
  "    {%- for tool in tools %}\n"
  "        {{- \"\\n\" }}\n"
  "        {{- tool | tojson }}\n"
  "    {%- endfor %}\n"
  "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
  "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
  "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
  "{%- else %}\n"
  "    {%- if messages[0]['role'] == 'system' %}\n"
  "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
  "    {%- else %}\n"
  "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
  "    {%- endif %}\n"
  "{%- endif %}\n"
  "{%- for message in messages %}\n"
  "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
  "(message.role == \"assistant\" and not message.tool_calls) %}\n"
  "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
  "    {%- elif message.role == \"assistant\" %}\n"
  "        {{- '<|im_start|>' + message.role }}\n"
  "        {%- if message.content %}\n"
  "            {{- '\\n' + message.content }}\n"
  "        {%- endif %}\n"
  "        {%- for tool_call in message.tool_calls %}\n"
  "            {%- if tool_call.function is defined %}\n"
  "                {%- set tool_call = tool_call.function %}\n"
  "            {%- endif %}\n"
  "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
  "            {{- tool_call.name }}\n"
  "            {{- '\", \"arguments\": ' }}\n"
  "            {{- tool_call.arguments | tojson }}\n"
  "            {{- '}\\n</tool_call>' }}\n"
  "        {%- endfor %}\n"
  "        {{- '<|im_end|>\\n' }}\n"
  "    {%- elif message.role == \"tool\" %}\n"
  "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
  "            {{- '<|im_start|>user' }}\n"
  "        {%- endif %}\n"
  "        {{- '\\n<tool_response>\\n' }}\n"
  "        {{- message.content }}\n"
  "        {{- '\\n</tool_response>' }}\n"
  "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
  "            {{- '<|im_end|>\\n' }}\n"
  "        {%- endif %}\n"
  "    {%- endif %}\n"
  "{%- endfor %}\n"
  "{%- if add_generation_prompt %}\n"
  "    {{- '<|im_start|>assistant\\n' }}\n"
  "{%- endif %}\n"
)


def chat_prompt(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
  """ChatML text exactly as Qwen2.5's template renders ``messages`` (no tools): Qwen's default
  system prompt when the first message is not a system message; a ``tool`` message run becomes
  one user turn of ``<tool_response>`` blocks."""
  for i, message in enumerate(messages):
    if message.get("role") not in ("system", "user", "assistant", "tool"):
      raise ValueError(f"messages[{i}]: unknown role {message.get('role')!r}")
    if not isinstance(message.get("content"), str):
      raise ValueError(f"messages[{i}]: content must be a string")
    if message.get("tool_calls"):
      raise ValueError(f"messages[{i}]: tool_calls are not supported by chat_prompt")
  if not messages:
    raise ValueError("messages is empty")
  first_is_system = messages[0]["role"] == "system"
  system = messages[0]["content"] if first_is_system else DEFAULT_SYSTEM_PROMPT
  parts = [f"{IM_START}system\n{system}{IM_END}\n"]
  for i, message in enumerate(messages):
    role, content = message["role"], message["content"]
    if role == "tool":
      previous_is_tool = i > 0 and messages[i - 1]["role"] == "tool"
      next_is_tool = i + 1 < len(messages) and messages[i + 1]["role"] == "tool"
      parts.append(("" if previous_is_tool else f"{IM_START}user")
                   + f"\n<tool_response>\n{content}\n</tool_response>"
                   + ("" if next_is_tool else f"{IM_END}\n"))
    elif not (i == 0 and first_is_system):
      parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
  if add_generation_prompt:
    parts.append(f"{IM_START}assistant\n")
  return "".join(parts)


def build_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str
                    ) -> transformers.PreTrainedTokenizerFast:
  """Train a byte-level BPE of at most ``vocab_size`` tokens (256 byte symbols, learned merges,
  then Qwen's special tokens) on ``texts``; save it as a HF tokenizer directory in ``out_dir``."""
  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(f"vocab_size={vocab_size} is below the {256 + len(SPECIAL_TOKENS)} byte and "
                     "special tokens a byte-level BPE needs")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.normalizer = normalizers.NFC()
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tokenizer, eos_token=IM_END, pad_token=ENDOFTEXT,
    chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=131072)
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(out_dir)
  return load_tokenizer(out_dir)


# ``tokenizer_class`` values naming the generic tokenizers-library class (``build_tokenizer``
# writes the first), which ``AutoTokenizer`` resolves to ``PreTrainedTokenizerFast``.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(local_dir: str) -> transformers.PreTrainedTokenizerBase:
  """``AutoTokenizer`` from a local directory only (never the hub). A directory whose
  ``tokenizer_class`` is the generic one loads that class directly: ``AutoTokenizer``'s config
  machinery imports torch (~1.5 s of every training process's start-up) to resolve it."""
  if not os.path.isdir(local_dir):
    raise FileNotFoundError(f"tokenizer directory {local_dir!r} does not exist")
  if _tokenizer_class(local_dir) in GENERIC_TOKENIZER_CLASSES:
    return transformers.PreTrainedTokenizerFast.from_pretrained(local_dir, local_files_only=True)
  return transformers.AutoTokenizer.from_pretrained(local_dir, local_files_only=True)


def _tokenizer_class(local_dir: str) -> str | None:
  try:
    with open(os.path.join(local_dir, "tokenizer_config.json"), encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError):
    return None   # AutoTokenizer says what is missing or malformed
  return config.get("tokenizer_class") if isinstance(config, dict) else None

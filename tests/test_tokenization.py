"""Tokenizer builder and ChatML formatting against transformers' apply_chat_template."""
import json
import subprocess
import sys

import pytest
import transformers

from jaxes import tokenization
from helpers_models import tiny_tokenizer

CONVERSATIONS = {
  "user-only": [{"role": "user", "content": "list files"}],
  "system-first": [{"role": "system", "content": "You are a terminal agent."},
                   {"role": "user", "content": "list files"}],
  "multi-turn": [{"role": "system", "content": "sys"},
                 {"role": "user", "content": "task: make dir"},
                 {"role": "assistant", "content": "<command>mkdir d</command>"},
                 {"role": "user", "content": "Command executed successfully. Output: \n\n(exit_code=0)"},
                 {"role": "assistant", "content": "<action>done</action>"}],
  "late-system-and-tools": [{"role": "user", "content": "a"},
                            {"role": "system", "content": "b\nc"},
                            {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                            {"role": "assistant", "content": ""},
                            {"role": "tool", "content": "r3"}],
  "unicode": [{"role": "user", "content": "héllo ✓ <|im_end|> literal"}],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=300)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_equals_apply_chat_template(tokenizer, name, add_generation_prompt):
  messages = CONVERSATIONS[name]
  expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
  assert tokenization.chat_prompt(messages, add_generation_prompt) == expected


def test_chat_prompt_shape_is_chatml():
  text = tokenization.chat_prompt([{"role": "user", "content": "hi"}])
  assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                  "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_built_tokenizer_round_trips_and_has_special_tokens(tokenizer):
  assert len(tokenizer) <= 300
  ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenization.SPECIAL_TOKENS]
  assert ids == list(range(len(tokenizer) - 3, len(tokenizer)))  # after the vocabulary, as Qwen
  assert tokenizer.eos_token == tokenization.IM_END
  text = "echo 'naïve ☃ text never seen' | wc -c\n\tdone"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  prompt = tokenization.chat_prompt([{"role": "user", "content": "ls"}])
  encoded = tokenizer.encode(prompt)
  assert encoded.count(tokenizer.convert_tokens_to_ids(tokenization.IM_END)) == 2
  reloaded = tokenization.load_tokenizer(tokenizer.name_or_path)
  assert reloaded.encode(prompt) == encoded


@pytest.mark.end_to_end
def test_a_built_tokenizer_loads_as_auto_tokenizer_loads_it_without_importing_torch(tokenizer):
  """``load_tokenizer`` skips ``AutoTokenizer`` for the generic class: the same tokenizer, and a
  training process's start-up does not pay for torch."""
  path = tokenizer.name_or_path
  with open(f"{path}/tokenizer_config.json") as f:
    assert json.load(f)["tokenizer_class"] in tokenization.GENERIC_TOKENIZER_CLASSES
  direct, auto = tokenization.load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
  assert type(direct) is type(auto)
  assert direct.get_vocab() == auto.get_vocab()
  assert direct.all_special_tokens == auto.all_special_tokens
  assert (direct.eos_token, direct.pad_token) == (auto.eos_token, auto.pad_token)
  for messages in CONVERSATIONS.values():
    text = direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert direct.encode(text) == auto.encode(text)
    assert direct.decode(direct.encode(text)) == auto.decode(auto.encode(text))
  probe = ("import sys; from jaxes import tokenization; "
           f"tokenization.load_tokenizer({path!r}); print('torch' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_bad_inputs_fail_clearly(tmp_path):
  with pytest.raises(ValueError, match="vocab_size=100"):
    tokenization.build_tokenizer(["abc"], 100, str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does-not-exist"):
    tokenization.load_tokenizer(str(tmp_path / "does-not-exist"))
  with pytest.raises(ValueError, match=r"messages\[1\]: unknown role 'robot'"):
    tokenization.chat_prompt([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])

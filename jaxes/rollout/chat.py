"""Token-level ChatML for multi-turn episodes, built turn by turn exactly as the engine feeds it.

A conversation is tokenized in segments split at special tokens, so the ids of an episode decoded
incrementally (prompt, then the model's own tokens, then each observation) are the ids a
supervised transcript of the same text gets: ``prompt_ids`` + for each turn ``assistant ids +
<|im_end|>`` + ``observation_ids``. The text equals ``tokenization.chat_prompt`` of the messages.
"""
from __future__ import annotations

from jaxes import tokenization


def prompt_ids(tok, messages: list[dict]) -> list[int]:
  """System + first user message + the assistant header."""
  return tok.encode(tokenization.chat_prompt(messages, add_generation_prompt=True), add_special_tokens=False)


def observation_text(content: str) -> str:
  """What follows an assistant turn's <|im_end|>: the user (observation) turn and the next header."""
  return f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def observation_ids(tok, content: str) -> list[int]:
  return tok.encode(observation_text(content), add_special_tokens=False)


def transcript_ids(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
  """Ids of a whole conversation (system, user, then assistant/user alternating, ending with an
  assistant turn) and a mask marking the assistant tokens (content and its <|im_end|>), the
  targets of supervised training."""
  first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
  ids = prompt_ids(tok, messages[:first_assistant])
  mask = [False] * len(ids)
  im_end = tok.convert_tokens_to_ids(tokenization.IM_END)
  for m in messages[first_assistant:]:
    if m["role"] == "assistant":
      piece = tok.encode(m["content"], add_special_tokens=False) + [im_end]
      ids += piece
      mask += [True] * len(piece)
    else:
      piece = observation_ids(tok, m["content"])
      ids += piece
      mask += [False] * len(piece)
  return ids, mask

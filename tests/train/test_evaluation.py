"""The held-out evaluation's format rate: replies the environment's protocol parses, counted from
the sampled tokens as the engine saw them."""
import pytest
from helpers_train import build_tiny_tokenizer, tiny_config

from jaxes import tokenization
from jaxes.rollout.episodes import EpisodeResult, EpisodeSpec, EpisodeStream
from jaxes.train import builders, evaluation

REPLIES = ["Let me list.\n```bash\nls /home/user\n```",      # fenced: parses
           "<command>ls /home/user</command>",                # tags: parses
           "```python\nprint(1)\n```",                        # neither
           "I am ready to help. What is your task?"]          # neither


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  out = build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
  return tokenization.load_tokenizer(out), out


def _result(tok, replies):
  turns = tuple(tuple(tok.encode(r, add_special_tokens=False)) for r in replies)
  stream = EpisodeStream(prompt=(1, 2), turns=turns, logprobs=tuple((0.0,) * len(t) for t in turns),
                         observations=((3,),) * (len(turns) - 1))
  return EpisodeResult(EpisodeSpec(None, None, 0, -1, 0), 0.0, False, len(turns), None, False, 0.0, stream)


@pytest.mark.parametrize("action_format,parsed", [("tags", 1), ("fenced", 1)])
def test_reply_counter_counts_what_the_configured_format_parses(tokenizer, action_format, parsed):
  tok, path = tokenizer
  c = tiny_config(path)
  c.env.action_format = action_format
  count = evaluation.reply_counter(tok, builders.reply_parses(c))
  assert count(_result(tok, REPLIES)) == (parsed, 4)
  assert count(_result(tok, REPLIES[:1])) == (int(action_format == "fenced"), 1)
  never_started = EpisodeResult(EpisodeSpec(None, None, 0, -1, 0), None, False, 0, "SANDBOX_ERROR", False, 0.0)
  assert count(never_started) == (0, 0)

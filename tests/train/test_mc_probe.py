"""Multiple-choice log-likelihood probes (jaxes.train.mc_probe): the batched, padded scorer
against one forward per row with a numpy log-softmax, accuracy from hand-worked scores, the
bundled set, the item file's errors and the config key. A run's metrics carrying the probe:
tests/train/test_trainer.py::test_resume_equals_uninterrupted."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_models import tiny_model, tiny_tokenizer

from jaxes.models import qwen2
from jaxes.train import mc_probe
from jaxes.train.config import ConfigError, load_config_file, validate
import helpers_repo

ROOT = helpers_repo.REPO


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model(tokenizer):
  return tiny_model("tiny-gqa", vocab_size=len(tokenizer))


@functools.partial(jax.jit, static_argnums=0)
def _row_logits(graphdef, params, ids):
  # One row alone, no padding mask: causal attention keeps the positions after the row's end
  # (zeros) out of its logits.
  n = ids.shape[0]
  return qwen2.forward(graphdef, params, ids[None], jnp.arange(n)[None], jnp.ones((1, n), bool))[0][0]


def _reference(graphdef, params, rows) -> np.ndarray:
  """Each real row alone: float64 log-softmax of the forward's logits, summed over the choice's
  tokens."""
  out = np.zeros(len(rows.item))
  for r in np.flatnonzero(rows.item >= 0):
    x = np.asarray(_row_logits(graphdef, params, jnp.asarray(rows.tokens[r])), np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    t = np.flatnonzero(rows.scored[r])
    out[r] = logp[t - 1, rows.tokens[r, t]].sum()
  return out


def test_scores_match_a_forward_per_row_and_accuracy_is_deterministic(model, tokenizer):
  _, graphdef, params = model
  items = mc_probe.load_items(mc_probe.bundled_path())
  # 5 four-choice items and the two-choice one: 22 rows, padded to 24 (3 steps of 8)
  items = items[:5] + [it for it in items if len(it.choices) == 2]
  rows = mc_probe.encode(items, tokenizer)
  assert rows.tokens.shape[0] % mc_probe.ROWS_PER_STEP == 0 and (rows.item < 0).any()
  got = mc_probe.log_likelihoods(graphdef, params, rows)
  want = _reference(graphdef, params, rows)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  assert np.all(got[rows.item >= 0] < 0) and np.all(got[rows.item < 0] == 0)
  # Deterministic: the same program on the same rows gives the same bits, so the same measures,
  # and they are the reference scores' measures.
  np.testing.assert_array_equal(mc_probe.log_likelihoods(graphdef, params, rows), got)
  assert mc_probe.accuracy(rows, got) == pytest.approx(mc_probe.accuracy(rows, want))


def test_accuracy_by_hand():
  # Two items: (3 choices, answer 1), (2 choices, answer 0); choice token counts 1, 4, 1 | 2, 1.
  scored = np.zeros((8, 6), bool)
  for r, n in enumerate([1, 4, 1, 2, 1]):
    scored[r, 1:1 + n] = True
  rows = mc_probe.Rows(tokens=np.zeros((8, 6), np.int32), valid=scored, scored=scored,
                       item=np.array([0, 0, 0, 1, 1, -1, -1, -1]), choice=np.array([0, 1, 2, 0, 1, 0, 0, 0]),
                       answers=np.array([1, 0]), num_choices=np.array([3, 2]))
  # Item 0: sums -2, -4, -3 -> choice 0 (wrong); per token -2, -1, -3 -> choice 1 (right).
  # Item 1: sums -1, -1 (a tie: the first choice, right); per token -0.5, -1 -> choice 0 (right).
  got = mc_probe.accuracy(rows, np.array([-2.0, -4.0, -3.0, -1.0, -1.0, 0, 0, 0]))
  assert got == pytest.approx({"accuracy": 0.5, "stderr": 0.5 / np.sqrt(2), "accuracy_per_token": 1.0,
                               "answer_logprob": (-1.0 - 0.5) / 2, "items": 2,
                               "chance": (1 / 3 + 1 / 2) / 2})


def test_bundled_set_and_continuations(tokenizer):
  items = mc_probe.load_items(mc_probe.resolve("bundled"))
  assert len(items) == 32 and {len(it.choices) for it in items} <= {2, 3, 4}
  assert len({it.answer for it in items}) > 1   # the answer is not always the same position
  assert mc_probe.resolve("") is None and mc_probe.resolve("x.jsonl") == "x.jsonl"
  assert mc_probe.continuation("Answer:", "5") == " 5"
  assert mc_probe.continuation("Answer: ", "5") == "5" and mc_probe.continuation("A", " b") == " b"
  rows = mc_probe.encode(items[:1], tokenizer)
  ctx = tokenizer.encode(items[0].context, add_special_tokens=False)
  for r, choice in enumerate(items[0].choices):   # the scored tokens are exactly the choice's
    want = tokenizer.encode(" " + choice, add_special_tokens=False)
    assert rows.tokens[r][rows.scored[r]].tolist() == want
    assert rows.tokens[r, :len(ctx)].tolist() == ctx and not rows.scored[r, :len(ctx)].any()
  # The preflight's bound without a tokenizer holds the real encoding (a token is >= 1 byte).
  whole = mc_probe.encode(items, tokenizer)
  bound = mc_probe.rows_bound(items)
  assert whole.tokens.shape[0] == bound[0] and whole.tokens.shape[1] <= bound[1]


@pytest.mark.parametrize("line,message", [
    ("not json", "not JSON"),
    (json.dumps({"context": "a", "choices": ["b"], "answer": 0}), "choices must be a list of at least 2"),
    (json.dumps({"context": "a", "choices": ["b", "c"], "answer": 2}), r"answer must be an index into choices \(0..1\)"),
    (json.dumps({"context": "", "choices": ["b", "c"], "answer": 0}), "context must be"),
    (json.dumps({"context": "a", "choices": ["b", "c"], "answer": 0, "label": 1}), "must be an object"),
])
def test_bad_item_file_is_one_line_naming_file_and_line(tmp_path, line, message):
  path = tmp_path / "items.jsonl"
  path.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "answer": 1}) + "\n\n" + line + "\n")
  with pytest.raises(ValueError, match=f"items.jsonl:3: {message}"):
    mc_probe.load_items(str(path))
  with pytest.raises(ValueError, match="cannot be read"):
    mc_probe.load_items(str(tmp_path / "missing.jsonl"))


def test_config_key_is_checked_up_front(tmp_path):
  c = load_config_file(ROOT / "configs" / "demo.py")
  assert c.eval.mc_probe_file == ""   # off by default
  c.eval.mc_probe_file = "bundled"
  validate(c)
  bad = tmp_path / "items.jsonl"
  bad.write_text('{"context": "a", "choices": ["b", "c"], "answer": 5}\n')
  for value, match in ((str(tmp_path / "none.jsonl"), "must be 'bundled' or a JSONL file"),
                       (str(bad), r"items.jsonl:1: answer must be an index")):
    c.eval.mc_probe_file = value
    with pytest.raises(ConfigError, match=r"config\.eval\.mc_probe_file: .*" + match):
      validate(c)
  c.eval.mc_probe_file, c.eval.num_tasks = "bundled", 0
  with pytest.raises(ConfigError, match=r"config\.eval\.mc_probe_file: is scored at each evaluation"):
    validate(c)

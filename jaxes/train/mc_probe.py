"""Multiple-choice log-likelihood probes: what the policy still knows off its training tasks.

Beside held-out success on task families the run does not train on (``eval.probe_families``), a
pretrained checkpoint's general knowledge can be probed the way HellaSwag-style benchmarks do it,
without sampling: for each item, every choice is appended to the context and the policy's
teacher-forced log-likelihood of the choice's tokens is its score; the item counts as right when
the answer's score is the highest. ES fine-tuning loses such scores as it drifts from θ₀ (arXiv
2601.20861), so they are recorded at every evaluation (``eval.mc_probe_file``), version 0 included.

Items are JSON lines ``{"context": str, "choices": [str, ...], "answer": int}`` (answer: index
into choices, at least two choices). A choice follows its context after one space, unless the
context ends in whitespace or the choice starts with it. ``eval.mc_probe_file = "bundled"`` takes
the 32 short commonsense and arithmetic items shipped in ``jaxes/data/mc_probe.jsonl`` (written
for jaxes; nothing is downloaded). On a randomly initialised model the probe sits near chance; it
is meant for a Hugging Face checkpoint (``model.path``).

Reported (``eval.mc_probe`` in the metrics line):

* ``accuracy``: the answer has the highest summed log-likelihood (``stderr``: binomial s.e.);
* ``accuracy_per_token``: the same with each choice's mean log-likelihood per token (long
  choices not penalised for their length);
* ``answer_logprob``: the answer's mean log-likelihood per token, averaged over items: it moves
  with every update where accuracy moves in steps;
* ``items`` and ``chance`` (the mean of 1 / number of choices).

The scores come from one jitted program over every (item, choice) row, ``ROWS_PER_STEP`` rows at
a time (``jaxes.rl.objective.sequence_logprobs``: the logits of those rows are the largest thing
held), over the parameters where they live.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxes.rl import objective

BUNDLED = "bundled"
ROWS_PER_STEP = 8


def bundled_path() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "mc_probe.jsonl")


def resolve(setting: str) -> str | None:
  """The file ``eval.mc_probe_file`` names ("" = none, "bundled" = the shipped set)."""
  setting = setting.strip()
  if not setting:
    return None
  return bundled_path() if setting == BUNDLED else setting


@dataclasses.dataclass(frozen=True)
class Item:
  context: str
  choices: tuple[str, ...]
  answer: int


def _item(record, where: str) -> Item:
  if not isinstance(record, dict) or set(record) - {"context", "choices", "answer"}:
    raise ValueError(f"{where}: must be an object with context, choices, answer (and nothing else)")
  context, choices, answer = record.get("context"), record.get("choices"), record.get("answer")
  if not isinstance(context, str) or not context:
    raise ValueError(f"{where}: context must be a non-empty string")
  if (not isinstance(choices, list) or len(choices) < 2
      or not all(isinstance(c, str) and c.strip() for c in choices)):
    raise ValueError(f"{where}: choices must be a list of at least 2 non-empty strings")
  if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
    raise ValueError(f"{where}: answer must be an index into choices (0..{len(choices) - 1}), "
                     f"got {answer!r}")
  return Item(context, tuple(choices), answer)


def load_items(path: str) -> list[Item]:
  """The items of a JSONL file (blank lines skipped); ValueError naming the file and line."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError as err:
    raise ValueError(f"{path}: cannot be read ({err.strerror})") from err
  items = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as err:
      raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from err
    items.append(_item(record, f"{path}:{n}"))
  if not items:
    raise ValueError(f"{path}: no items")
  return items


def continuation(context: str, choice: str) -> str:
  """The text scored after ``context``: ``choice``, after one space where neither side has one."""
  return choice if context[-1].isspace() or choice[0].isspace() else " " + choice


@dataclasses.dataclass(frozen=True)
class Rows:
  """One row per (item, choice), right-padded: ``tokens`` [R, S] (R a multiple of
  ``ROWS_PER_STEP``; padding rows are all invalid), ``valid`` [R, S], ``scored`` [R, S] (the
  choice's tokens); ``item`` [R] (-1 on padding rows), ``choice`` [R]; ``answers`` [N] and
  ``num_choices`` [N] per item."""
  tokens: np.ndarray
  valid: np.ndarray
  scored: np.ndarray
  item: np.ndarray
  choice: np.ndarray
  answers: np.ndarray
  num_choices: np.ndarray


def encode(items: list[Item], tokenizer) -> Rows:
  """Each choice's row: the context's token ids, then the continuation's (tokenized apart, so
  the scored tokens are exactly the choice's whatever the merges across the boundary)."""
  ids, scored, item_of, choice_of = [], [], [], []
  for i, it in enumerate(items):
    ctx = tokenizer.encode(it.context, add_special_tokens=False)
    for j, choice in enumerate(it.choices):
      cont = tokenizer.encode(continuation(it.context, choice), add_special_tokens=False)
      ids.append(ctx + cont)
      scored.append([False] * len(ctx) + [True] * len(cont))
      item_of.append(i)
      choice_of.append(j)
  rows = -(-len(ids) // ROWS_PER_STEP) * ROWS_PER_STEP
  length = max(map(len, ids))
  tokens = np.zeros((rows, length), np.int32)
  valid = np.zeros((rows, length), bool)
  mask = np.zeros((rows, length), bool)
  for r, (row, s) in enumerate(zip(ids, scored)):
    tokens[r, :len(row)], valid[r, :len(row)], mask[r, :len(row)] = row, True, s
  pad = rows - len(ids)
  return Rows(tokens, valid, mask, np.array(item_of + [-1] * pad, np.int32),
              np.array(choice_of + [0] * pad, np.int32),
              np.array([it.answer for it in items], np.int32),
              np.array([len(it.choices) for it in items], np.int32))


def _mesh_of(params):
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(params)]
  if shardings and all(isinstance(s, NamedSharding) for s in shardings):
    return shardings[0].mesh
  return None


@functools.lru_cache(maxsize=8)
def _program(graphdef, mesh):
  def score(params, tokens, valid, scored):
    def step(chunk):
      t, v, s = chunk
      logp = objective.sequence_logprobs(graphdef, params, t, v, 1.0, 1.0)
      return jnp.sum(jnp.where(s, logp, 0.0), axis=1)
    shape = (-1, ROWS_PER_STEP, tokens.shape[1])
    sums = jax.lax.map(step, (tokens.reshape(shape), valid.reshape(shape), scored.reshape(shape)))
    return sums.reshape(-1)
  if mesh is None:
    return jax.jit(score)
  # Replicated in and out: every process holds the whole (small) result it reads back.
  return jax.jit(score, out_shardings=NamedSharding(mesh, PartitionSpec()))


def rows_bound(items: list[Item]) -> tuple[int, int]:
  """(rows, length) that ``encode(items, tokenizer)`` stays within for a byte-level tokenizer
  (or a coarser one: no token is shorter than one UTF-8 byte), for sizing without a tokenizer."""
  lengths = [len((it.context + continuation(it.context, c)).encode()) for it in items for c in it.choices]
  return -(-len(lengths) // ROWS_PER_STEP) * ROWS_PER_STEP, max(lengths)


def lowering(graphdef, params, rows: int, length: int):
  """The scorer's program lowered for parameters placed like ``params`` (abstract arrays) and
  ``rows`` x ``length`` token rows, as the preflight sizes it (``ROWS_PER_STEP`` rows' float32
  logits at a time are its largest buffers)."""
  mesh = _mesh_of(params)
  sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
  spec = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype, sharding=sharding)
  return _program(graphdef, mesh).lower(params, spec(jnp.int32), spec(jnp.bool_), spec(jnp.bool_))


def log_likelihoods(graphdef, params, rows: Rows) -> np.ndarray:
  """float32 [R]: each row's summed log-likelihood of its choice's tokens (0 on padding rows)."""
  mesh = _mesh_of(params)
  inputs = (rows.tokens, rows.valid, rows.scored)
  if mesh is not None:
    inputs = jax.device_put(inputs, NamedSharding(mesh, PartitionSpec()))
  out = _program(graphdef, mesh)(params, *inputs)
  return np.asarray(out.addressable_data(0))


def accuracy(rows: Rows, sums: np.ndarray) -> dict:
  """The probe's measures (module docstring) from each row's summed log-likelihood ``sums``;
  a tie goes to the first choice."""
  n, width = len(rows.answers), int(rows.num_choices.max())
  real = rows.item >= 0
  counts = rows.scored.sum(axis=1)
  total = np.full((n, width), -np.inf)
  per_token = np.full((n, width), -np.inf)
  total[rows.item[real], rows.choice[real]] = sums[real]
  per_token[rows.item[real], rows.choice[real]] = sums[real] / counts[real]
  idx = np.arange(n)
  acc = float(np.mean(np.argmax(total, axis=1) == rows.answers))
  return {"accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / n),
          "accuracy_per_token": float(np.mean(np.argmax(per_token, axis=1) == rows.answers)),
          "answer_logprob": float(np.mean(per_token[idx, rows.answers])),
          "items": n, "chance": float(np.mean(1.0 / rows.num_choices))}


class Probe:
  """The probe of one run: the items of ``path`` encoded once with the run's ``tokenizer``;
  ``probe(params)`` scores them (every process of a multi-process run calls it)."""

  def __init__(self, graphdef, path: str, tokenizer):
    self.graphdef, self.path = graphdef, path
    self.rows = encode(load_items(path), tokenizer)

  def __call__(self, params) -> dict:
    return accuracy(self.rows, log_likelihoods(self.graphdef, params, self.rows))

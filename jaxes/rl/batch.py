"""Training batches of finished multi-turn episodes for policy-gradient learners.

An episode's tokens are exactly what the engine fed its cache row: ``chat.prompt_ids`` of the
system and first user message, then per assistant turn the sampled ids, the ``<|im_end|>`` the
engine appends when the token budget (not a stop id) ended the turn, and ``chat.observation_ids``
of the next user message. Only sampled ids are trained on (``sampled``); the system prompt, user
turns, observations and the appended ``<|im_end|>`` are context. Nothing after the last turn is
kept: the engine never fed it, and causal attention makes it irrelevant to the loss.

``episode_from_stream`` takes the token stream the rollout runner records (exact, what the GRPO
trainer uses); ``episode_from_turns`` the engine's sampled ids and behaviour log-probs per turn
with the transcript's messages (exact);
``episode_from_messages`` re-encodes the assistant text of a transcript (``chat.transcript_ids``),
which matches the sampled ids only where decode-then-encode is the identity (BPE need not be).
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import jax
import numpy as np

from jaxes import tokenization
from jaxes.rollout import chat


@dataclasses.dataclass(frozen=True)
class EpisodeTokens:
  """One episode's token ids [n], which of them the policy sampled [n], and the log-prob of each
  sampled id under the policy that sampled it [n] (0 elsewhere)."""
  ids: np.ndarray
  sampled: np.ndarray
  behaviour_logp: np.ndarray

  def __post_init__(self):
    n = len(self.ids)
    if len(self.sampled) != n or len(self.behaviour_logp) != n:
      raise ValueError(f"EpisodeTokens: ids ({n}), sampled ({len(self.sampled)}) and "
                       f"behaviour_logp ({len(self.behaviour_logp)}) must have the same length")
    if n and self.sampled[0]:
      raise ValueError("EpisodeTokens: the first token cannot be sampled (nothing precedes it)")


def _first_assistant(messages: Sequence[dict]) -> int:
  for i, m in enumerate(messages):
    if m["role"] == "assistant":
      return i
  raise ValueError("episode has no assistant turn: nothing to train on")


def episode_from_turns(tok, messages: Sequence[dict], turns: Sequence[Sequence[int]],
                       logprobs: Sequence[Sequence[float]]) -> EpisodeTokens:
  """``messages``: the episode's transcript (``protocol.Episode.messages``); ``turns``: the ids
  the engine sampled per assistant turn (``engine.Turn.tokens``, stop id included); ``logprobs``:
  their behaviour log-probs, one per id."""
  first = _first_assistant(messages)
  assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if len(assistants) != len(turns) or len(turns) != len(logprobs):
    raise ValueError(f"episode has {len(assistants)} assistant messages, {len(turns)} sampled turns "
                     f"and {len(logprobs)} log-prob lists; they must match")
  im_end = tok.convert_tokens_to_ids(tokenization.IM_END)
  ids = list(chat.prompt_ids(tok, messages[:first]))
  sampled, logp = [False] * len(ids), [0.0] * len(ids)
  for k, (turn, turn_logp) in enumerate(zip(turns, logprobs)):
    if len(turn) != len(turn_logp) or not turn:
      raise ValueError(f"turn {k}: {len(turn)} sampled ids but {len(turn_logp)} log-probs "
                       "(need one per id, at least one)")
    ids += [int(t) for t in turn]
    sampled += [True] * len(turn)
    logp += [float(x) for x in turn_logp]
    if k + 1 == len(turns):
      break
    following = messages[assistants[k] + 1]
    if following["role"] != "user":
      raise ValueError(f"message {assistants[k] + 1}: expected the observation (a user message) "
                       f"after assistant turn {k}, got role {following['role']!r}")
    context = ([] if turn[-1] == im_end else [im_end]) + chat.observation_ids(tok, following["content"])
    ids += context
    sampled += [False] * len(context)
    logp += [0.0] * len(context)
  return EpisodeTokens(np.asarray(ids, np.int32), np.asarray(sampled, bool),
                       np.asarray(logp, np.float32))


def episode_from_stream(stream, im_end: int) -> EpisodeTokens:
  """An ``episodes.EpisodeStream`` (what the engine fed and sampled: prompt ids, per turn the
  sampled ids and their log-probs, the observation ids between turns) laid out as above. Exact
  by construction, and known on every process of a multi-process run."""
  if not stream.turns:
    raise ValueError("episode has no sampled turn: nothing to train on")
  if len(stream.observations) != len(stream.turns) - 1:
    raise ValueError(f"episode has {len(stream.turns)} turns but {len(stream.observations)} "
                     "observations between them (need one fewer)")
  ids, sampled, logp = list(stream.prompt), [False] * len(stream.prompt), [0.0] * len(stream.prompt)
  for k, (turn, turn_logp) in enumerate(zip(stream.turns, stream.logprobs)):
    if len(turn) != len(turn_logp) or not turn:
      raise ValueError(f"turn {k}: {len(turn)} sampled ids but {len(turn_logp)} log-probs "
                       "(need one per id, at least one)")
    ids += turn
    sampled += [True] * len(turn)
    logp += turn_logp
    if k < len(stream.observations):
      context = ([] if turn[-1] == im_end else [im_end]) + list(stream.observations[k])
      ids += context
      sampled += [False] * len(context)
      logp += [0.0] * len(context)
  return EpisodeTokens(np.asarray(ids, np.int32), np.asarray(sampled, bool),
                       np.asarray(logp, np.float32))


def episode_from_messages(tok, messages: Sequence[dict],
                          behaviour_logp: Sequence[float] | None = None) -> EpisodeTokens:
  """A transcript re-encoded by ``chat.transcript_ids`` (assistant content and its
  ``<|im_end|>`` are the sampled tokens); ``behaviour_logp`` holds one log-prob per sampled token
  in order (None: zeros, for supervised checks only)."""
  ids, mask = chat.transcript_ids(tok, list(messages))
  mask = np.asarray(mask, bool)
  logp = np.zeros(len(ids), np.float32)
  if behaviour_logp is not None:
    behaviour_logp = np.asarray(behaviour_logp, np.float32)
    if behaviour_logp.shape != (int(mask.sum()),):
      raise ValueError(f"behaviour_logp has shape {behaviour_logp.shape}, but the transcript has "
                       f"{int(mask.sum())} assistant tokens")
    logp[mask] = behaviour_logp
  return EpisodeTokens(np.asarray(ids, np.int32), mask, logp)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
  """Fixed-shape arrays over ``N`` episode rows of ``S`` tokens, right-padded.

  tokens int32 [N, S]; valid bool [N, S] (a real token); sampled bool [N, S] (a token the policy
  sampled: the loss's targets); behaviour_logp float32 [N, S]; rewards float32 [N]; group_ids
  int32 [N] in 0..N-1 (episodes of one task share one), -1 for padding rows.
  """
  tokens: jax.Array
  valid: jax.Array
  sampled: jax.Array
  behaviour_logp: jax.Array
  rewards: jax.Array
  group_ids: jax.Array

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]


def build_batch(episodes: Sequence[EpisodeTokens], rewards: Sequence[float],
                groups: Sequence[Hashable], *, seq_len: int, num_rows: int | None = None) -> Batch:
  """Pads ``episodes`` to ``[num_rows, seq_len]`` (num_rows defaults to the episode count; extra
  rows are padding). ``groups``: any hashable per episode (e.g. the task id); episodes with equal
  keys form one advantage group. An episode longer than ``seq_len`` is an error: size ``seq_len``
  to the engine's ``max_len``, which bounds every episode."""
  n = len(episodes)
  if not (len(rewards) == len(groups) == n):
    raise ValueError(f"{n} episodes, {len(rewards)} rewards and {len(groups)} group keys: they must match")
  num_rows = n if num_rows is None else num_rows
  if num_rows < n:
    raise ValueError(f"num_rows={num_rows} is fewer than the {n} episodes")
  if not np.all(np.isfinite(np.asarray(rewards, np.float64))):
    raise ValueError("rewards must be finite (drop infrastructure failures before building a batch)")
  tokens = np.zeros((num_rows, seq_len), np.int32)
  valid = np.zeros((num_rows, seq_len), bool)
  sampled = np.zeros((num_rows, seq_len), bool)
  logp = np.zeros((num_rows, seq_len), np.float32)
  reward = np.zeros((num_rows,), np.float32)
  group_ids = np.full((num_rows,), -1, np.int32)
  index: dict = {}
  for i, (ep, r, g) in enumerate(zip(episodes, rewards, groups)):
    if len(ep.ids) > seq_len:
      raise ValueError(f"episode {i} has {len(ep.ids)} tokens, more than seq_len={seq_len}")
    m = len(ep.ids)
    tokens[i, :m], valid[i, :m], sampled[i, :m], logp[i, :m] = (ep.ids, True, ep.sampled,
                                                                 ep.behaviour_logp)
    reward[i] = r
    group_ids[i] = index.setdefault(g, len(index))
  return Batch(tokens, valid, sampled, logp, reward, group_ids)

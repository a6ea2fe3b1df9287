"""A bounded sample of training episodes per update, with their transcripts, in ``episodes.jsonl``.

Every finished training episode is offered; the first ``per_update`` of each update window are
kept (arrival order, so no extra randomness), their token streams decoded to text and each text
cut to ``max_chars`` (head and tail, with a note of what was cut). One JSON line per episode,
tagged with the update that followed it. The text is the model's and the sandbox's verbatim:
readers must treat it as hostile (``report`` escapes it).
"""
from __future__ import annotations

import json
import os

EPISODES = "episodes.jsonl"


def clip(text: str, max_chars: int) -> str:
  """``text`` cut to about ``max_chars``: its head and tail, saying how much was left out."""
  if len(text) <= max_chars:
    return text
  half = max_chars // 2
  return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def transcript(tok, stream, max_chars: int) -> list[dict]:
  """Prompt, model turns and observations as ``[{role, text}]`` (special tokens dropped)."""
  def text(ids):
    return clip(tok.decode(list(ids), skip_special_tokens=True,
                           clean_up_tokenization_spaces=False).strip(), max_chars)
  if stream is None:
    return []
  out = [{"role": "prompt", "text": text(stream.prompt)}]
  for i, turn in enumerate(stream.turns):
    out.append({"role": "model", "text": text(turn)})
    if i < len(stream.observations):
      observation = text(stream.observations[i])
      out.append({"role": "observation", "text": observation.removeprefix("user\n").removesuffix("\nassistant")})
  return out


def read_episodes(path: str) -> list[dict]:
  from jaxes.train.metrics import read_metrics   # the same torn-last-line rule
  return read_metrics(path)


class TranscriptSampler:
  """Keeps the first ``per_update`` training episodes of each update window (0: none) and
  appends them to ``workdir/episodes.jsonl`` at the update. On resume, lines of updates beyond
  the restored version are dropped (their episodes are decoded again)."""

  def __init__(self, workdir: str, tokenizer, per_update: int, max_chars: int, resume_version: int = 0):
    self.path = os.path.join(workdir, EPISODES)
    self.tok, self.per_update, self.max_chars = tokenizer, per_update, max_chars
    self._window: list = []
    kept = [e for e in read_episodes(self.path) if e.get("update", 0) <= resume_version]
    with open(self.path + ".tmp", "w") as f:
      f.writelines(json.dumps(e) + "\n" for e in kept)
    os.replace(self.path + ".tmp", self.path)

  def offer(self, result) -> None:
    """A finished training episode (``EpisodeResult`` whose key is a ``TrainEpisode``)."""
    if len(self._window) < self.per_update:
      self._window.append(result)

  def write(self, update: int) -> list[dict]:
    """Appends the window's episodes, tagged with the version ``update`` produced; returns them."""
    window, self._window = self._window, []
    entries = [self._entry(update, r) for r in window]
    if entries:
      with open(self.path, "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    return entries

  def _entry(self, update: int, r) -> dict:
    job = r.spec.key.job
    return {
        "update": update, "task": r.spec.task.name,
        "version": r.spec.version, "member": job.member, "episode": job.episode,
        "reward": r.reward, "passed": r.passed, "turns": r.turns, "failure": r.failure,
        "truncated": r.truncated, "transcript": transcript(self.tok, r.tokens, self.max_chars)}

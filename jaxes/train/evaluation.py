"""Held-out evaluation of the unperturbed policy, and how two evaluations compare.

An evaluation runs ``eval.num_tasks x eval.seeds`` episodes of the current version through the
same runner as training; training episodes already in flight keep running meanwhile and their
results go to ``on_training_result``. Success and mean reward are reported per task (mean over
seeds), so two evaluations of the same tasks compare by their paired per-task differences.
Success is the terminal tasks' measure; WebShop's score is the mean reward (Yao et al., 2022
report both), so a comparison names its ``Measure``.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Callable

import numpy as np

from jaxes.rollout.episodes import EpisodeResult, EpisodeRunner, EpisodeSpec
from jaxes.train import metrics

EVAL_STREAM_BASE = 1 << 30     # sampling streams of evaluation episodes (training: see trainer)


@dataclasses.dataclass(frozen=True)
class Measure:
  """Where one held-out measure lives: its mean and s.e. in an evaluation record, its per-task
  values, and its paired change in summary.json."""
  name: str
  stderr: str
  per_task: str
  change: str


SUCCESS = Measure("success", "stderr", "per_task", "change")
REWARD = Measure("reward", "reward_stderr", "per_task_reward", "reward_change")


@dataclasses.dataclass(frozen=True)
class EvalEpisode:
  """The key of an evaluation episode: repetition ``seed`` of held-out task ``task``."""
  seed: int
  task: int


def reply_counter(tokenizer, parses: Callable[[str], bool]) -> Callable[[EpisodeResult], tuple[int, int]]:
  """``result -> (replies the protocol parses, replies)`` from the episode's sampled tokens."""
  def count(result: EpisodeResult) -> tuple[int, int]:
    turns = result.tokens.turns if result.tokens is not None else ()
    texts = [tokenizer.decode(list(t), skip_special_tokens=True) for t in turns]
    return sum(map(parses, texts)), len(texts)
  return count


def evaluate(runner: EpisodeRunner, params_by_version: dict, version: int, tasks: list, *,
             seeds: int, temperature: float, top_p: float,
             on_training_result: Callable[[EpisodeResult], None], log=print,
             prepare: Callable[[EpisodeSpec], EpisodeSpec] = lambda spec: spec,
             name: str = "held-out", streams: dict | None = None,
             count_replies: Callable[[EpisodeResult], tuple[int, int]] | None = None) -> dict:
  """Success of ``params_by_version[version]`` unperturbed on ``tasks`` x ``seeds`` episodes.
  ``prepare``: each episode's spec as the run runs it (co-evolution: with the best context).
  ``name``: what the log line calls the tasks; ``streams``: filled with ``{task index: its
  seed-0 episode's EpisodeStream}`` (the drift measure's transcripts). ``count_replies``
  (``reply_counter``): adds the format rate, the fraction of model replies the protocol parses."""
  todo = [prepare(EpisodeSpec(EvalEpisode(s, i), task, version, -1, EVAL_STREAM_BASE + s * len(tasks) + i,
                              temperature, top_p))
          for s in range(seeds) for i, task in enumerate(tasks)]
  todo.reverse()
  passed = np.zeros((seeds, len(tasks)))
  rewards = np.zeros((seeds, len(tasks)))
  remaining, t, failures = len(todo), time.perf_counter(), Counter()
  parsed = replies = 0
  while remaining:
    for _ in runner.free_slots()[:len(todo)]:
      runner.submit(todo.pop())
    for r in runner.poll(params_by_version, block=True):
      if not isinstance(r.spec.key, EvalEpisode):
        on_training_result(r)
        continue
      s, i = r.spec.key.seed, r.spec.key.task
      passed[s, i], rewards[s, i] = float(r.passed), r.reward or 0.0
      if streams is not None and s == 0 and r.tokens is not None:
        streams[i] = r.tokens
      failures[r.failure or ("passed" if r.passed else "wrong")] += 1
      if count_replies is not None:
        ok, n = count_replies(r)
        parsed, replies = parsed + ok, replies + n
      remaining -= 1
  per_task = passed.mean(axis=0)  # s.e. over held-out tasks of the per-task success rate
  per_task_reward = rewards.mean(axis=0)
  nan = (float("nan"), float("nan"))
  success, stderr = metrics.mean_stderr(per_task) if len(tasks) else nan
  reward, reward_stderr = metrics.mean_stderr(per_task_reward) if len(tasks) else nan
  result = {"version": version, "success": success, "stderr": stderr,
            "reward": reward, "reward_stderr": reward_stderr,
            "episodes": int(passed.size), "seconds": time.perf_counter() - t,
            "failures": dict(failures), "per_task": per_task.tolist(),
            "per_task_reward": per_task_reward.tolist()}
  fmt = ""
  if count_replies is not None:
    result |= {"format_rate": parsed / replies if replies else None, "replies": replies}
    fmt = f", {parsed} of {replies} replies parsed"
  log(f"{name} eval at version {version}: success {success:.3f} ± {stderr:.3f} "
      f"({passed.size} episodes, {result['seconds']:.0f}s{fmt})")
  return result


def paired_change(before: dict | None, after: dict | None, measure: Measure = SUCCESS) -> dict | None:
  """Held-out ``measure`` after minus before on the same tasks, with the standard error of the
  per-task differences (much tighter than comparing two independent ± s.e.)."""
  key = measure.per_task
  if not before or not after or key not in before or len(before[key]) != len(after.get(key, [])):
    return None
  diff, stderr = metrics.mean_stderr(np.subtract(after[key], before[key]))
  return {measure.name: diff, "stderr": stderr, "tasks": len(after[key])}


def format_table(before: dict, after: dict, name: str = "ES") -> str:
  rows = [("policy version", f"{before['version']}", f"{after['version']}"),
          ("held-out success", f"{before['success']:.3f} ± {before['stderr']:.3f}",
           f"{after['success']:.3f} ± {after['stderr']:.3f}"),
          ("held-out mean reward", f"{before['reward']:.3f}", f"{after['reward']:.3f}"),
          ("episodes", f"{before['episodes']}", f"{after['episodes']}")]
  change = paired_change(before, after)
  if change is not None:
    rows.append(("change (paired s.e.)", "", f"{change['success']:+.3f} ± {change['stderr']:.3f}"))
  change = paired_change(before, after, REWARD)
  if change is not None:
    rows.append(("reward change (paired s.e.)", "", f"{change['reward']:+.3f} ± {change['stderr']:.3f}"))
  width = max(len(r[0]) for r in rows)
  lines = [f"{'':{width}}  {'before ' + name:>16}  {'after ' + name:>16}"]
  lines += [f"{a:{width}}  {b:>16}  {c:>16}" for a, b, c in rows]
  return "\n".join(lines)

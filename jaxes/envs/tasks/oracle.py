"""Oracle transcripts of terminal tasks: the episodes a task's reference solution plays, which the
supervised warm start (``jaxes.train.warmstart``) trains on.

An oracle transcript is a real episode: turn 1 runs the solution as one command in a sandbox (the
observation is the real output), turn 2 says done; only transcripts whose final tests pass are
kept. ``off_protocol`` fences a seeded fraction of their commands (``jaxes.envs.webshop``'s
``off_protocol`` is the WebShop counterpart).
"""
from __future__ import annotations

import concurrent.futures as cf

import numpy as np


def oracle_messages(task, sandbox, make_episode) -> list[dict] | None:
  """The transcript of the oracle playing ``task``, or None if it does not pass."""
  if not task.solution:
    return None
  handle = sandbox.start(task)
  try:
    episode = make_episode(task, handle)
    episode.step(oracle_turn(task.solution))
    if not episode.done:
      episode.step("<action>done</action>")
    outcome = episode.finish()
  finally:
    handle.close()
  return list(episode.messages) if outcome.passed else None


def oracle_turn(solution: str) -> str:
  return f"<command>{solution.strip()}</command>"


def off_protocol(transcripts: list[list[dict]], fraction: float, seed: int) -> list[list[dict]]:
  """Rewrites the command turn of a seeded ``fraction`` of transcripts as a fenced code block,
  which the agent protocol does not accept (a parse error, as Endless Terminals scores it).

  A policy warm-started on the result knows how to solve the tasks but follows the harness's
  protocol only part of the time, as Instruct checkpoints do before RL: something reward can
  teach, and a gain that is the protocol's, not new skill (the demo says so)."""
  rng = np.random.default_rng(seed)
  out = []
  for messages in transcripts:
    messages = [dict(m) for m in messages]
    if rng.random() < fraction:
      turn = next(m for m in messages if m["role"] == "assistant")
      command = turn["content"].removeprefix("<command>").removesuffix("</command>")
      turn["content"] = f"```bash\n{command}\n```"
    out.append(messages)
  return out


def oracle_transcripts(tasks, sandbox, make_episode, workers: int) -> list[list[dict]]:
  with cf.ThreadPoolExecutor(workers) as pool:
    out = list(pool.map(lambda t: oracle_messages(t, sandbox, make_episode), tasks))
  return [m for m in out if m is not None]

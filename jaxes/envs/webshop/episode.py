"""WebShop episodes with the surface of ``jaxes.envs.protocol.Episode``, and the in-process backend.

The model emits one action per turn (``search[...]`` or ``click[...]``; see ``env``). Every
turn counts as a step, invalid or not; the episode ends at Buy Now or after ``max_steps`` turns
(15, as in WebShop's evaluation). The reward is WebShop's r of the purchase (0 without one);
``passed`` iff r = 1. ``parse_error_penalty=p`` subtracts ``p / max_steps`` per reply that holds
no action, like the terminal protocol's format reward (``passed`` is unaffected).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from jaxes.envs.protocol import PARSE_ERROR, EpisodeOutcome
from jaxes.envs.webshop.catalog import Goal
from jaxes.envs.webshop.env import WebShopSession, parse_action

MAX_STEPS = 15
NOT_PURCHASED = "NOT_PURCHASED"     # the step limit came before Buy Now

SYSTEM_PROMPT = """\
You are shopping in a web store for a user whose instruction is on the search page.
Each turn, reply with exactly one action:
  search[QUERY]     on the search page: search the store for QUERY
  click[ELEMENT]    click an element shown in [brackets] on the current page,
                    e.g. click[Next >], click[B0ABC12345], click[large], click[Buy Now]
Find a product that matches the instruction, open it, click one value of every option the
instruction asks for, then click[Buy Now].
The episode ends when you buy, or after {max_steps} actions.
You may think first; only the last action in your reply counts."""


class WebShopBackend:
  """Starts sessions in-process (the sandbox role for WebShop). Sessions share nothing mutable;
  the only shared state is the count of open sessions behind ``leftovers``."""

  def __init__(self):
    self._lock = threading.Lock()
    self._open = 0

  def start(self, goal: Goal) -> WebShopSession:
    if not isinstance(goal, Goal):
      raise TypeError(f"WebShopBackend.start: expected a webshop Goal, got {type(goal).__name__}")
    with self._lock:
      self._open += 1
    return WebShopSession(goal, on_close=self._closed)

  def _closed(self) -> None:
    with self._lock:
      self._open -= 1

  def shutdown(self) -> None:
    pass

  def leftovers(self) -> dict[str, int]:
    with self._lock:
      return {"sessions": self._open}


class WebShopEpisode:
  """One episode over a live session; the caller owns the session (starts and closes it)."""

  def __init__(self, goal: Goal, handle: WebShopSession, *, max_steps: int = MAX_STEPS,
               system_prompt: str | None = None, parse_error_penalty: float = 0.0,
               clock: Callable[[], float] = time.monotonic):
    if max_steps < 1:
      raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    self.goal, self.handle = goal, handle
    self.max_steps = max_steps
    self.parse_error_penalty = parse_error_penalty
    self._clock = clock
    self._start = clock()
    prompt = system_prompt if system_prompt else SYSTEM_PROMPT.format(max_steps=max_steps)
    self.messages: list[dict[str, str]] = [
        {"role": "system", "content": prompt},
        {"role": "user", "content": handle.observation()},
    ]
    self.turns = 0
    self.parse_errors = 0
    self.invalid_actions = 0           # parsed actions the page did not accept
    self.done = False
    self._outcome: EpisodeOutcome | None = None

  def step(self, model_text: str) -> bool:
    """Consumes one model turn; returns whether the episode is over."""
    if self.done:
      raise RuntimeError("step() after the episode ended; call finish()")
    self.turns += 1
    self.messages.append({"role": "assistant", "content": model_text})
    action = parse_action(model_text)
    result = self.handle.step(action)
    if action is None:
      self.parse_errors += 1
    elif not result.valid:
      self.invalid_actions += 1
    self.done = result.done or self.turns >= self.max_steps
    if not result.done:
      self.messages.append({"role": "user", "content": result.observation})
    return self.done

  def finish(self) -> EpisodeOutcome:
    """Scores the episode (idempotent)."""
    if self._outcome is not None:
      return self._outcome
    self.done = True
    purchase = self.handle.purchase
    score = purchase.reward if purchase is not None else 0.0
    passed = score >= 1.0 - 1e-9
    if passed:
      failure = None
    elif self.parse_errors:
      failure = PARSE_ERROR
    else:
      failure = None if purchase is not None else NOT_PURCHASED
    self._outcome = EpisodeOutcome(
        reward=score - self.parse_error_penalty * self.parse_errors / self.max_steps,
        passed=passed, fraction=score, turns=self.turns, parse_errors=self.parse_errors,
        failure=failure,
        timings={"total_s": self._clock() - self._start, "invalid_actions": self.invalid_actions,
                 "purchased": purchase is not None})
    return self._outcome


def play(backend: WebShopBackend, goal: Goal, agent: Callable[[list[dict]], str], *,
         max_steps: int = MAX_STEPS, **episode_kwargs) -> tuple[EpisodeOutcome, list[dict]]:
  """Starts a session, lets ``agent(messages) -> text`` play, scores, closes; returns the
  outcome and the transcript."""
  handle = backend.start(goal)
  try:
    episode = WebShopEpisode(goal, handle, max_steps=max_steps, **episode_kwargs)
    while not episode.step(agent(episode.messages)):
      pass
    return episode.finish(), episode.messages
  finally:
    handle.close()

"""WebShop (Yao et al., 2022) as an in-process environment with the terminal path's surface.

The trainer needs four things, each the WebShop counterpart of a terminal-path piece:

  goals   = make_goals(split, n, seed, start=0, **catalog_options)     # ~ trainer.make_tasks
  backend = WebShopBackend()                                          # ~ make_sandbox(...)
  handle  = backend.start(goal); ...; handle.close(); backend.shutdown()
  episode = WebShopEpisode(goal, handle, max_steps=15, system_prompt=None,
                           parse_error_penalty=0.0)                   # ~ protocol.Episode
  replies = oracle_replies(goal, max_steps=15)                        # ~ task.solution

* ``make_goals`` is deterministic from its arguments. ``split`` is "train" or "heldout" (and
  "dev" with released data); the splits never share a goal (generated: never a target product).
  ``catalog_options``: ``data_path`` (a folder with the released files; empty = the generated
  catalog), ``num_products`` (generated: 1000; released: all), ``catalog_seed`` and
  ``asin_length`` (generated), ``human_goals`` (released), ``max_steps`` (generated goals are kept
  only if the oracle solves them within it). A ``Goal`` has ``.name`` (unique per split) and ``.instruction`` (text) like a
  ``Task``; everything else about it is WebShop's business.
* ``WebShopBackend.start(goal)`` opens a session (the handle) in-process: no processes, no
  files; thread-safe; sessions share only the read-only catalog. ``leftovers()`` counts open
  sessions, as sandboxes count containers.
* ``WebShopEpisode`` has ``protocol.Episode``'s surface: ``.messages`` (system, then the search
  page as the first user message), ``.step(text) -> done``, ``.finish() ->
  protocol.EpisodeOutcome`` with ``reward`` = WebShop's r ∈ [0, 1] of the purchase (0 without
  one; minus the format penalty), ``passed`` iff r = 1, ``fraction`` = r, ``turns``,
  ``parse_errors``, ``failure`` (None, ``PARSE_ERROR`` or ``NOT_PURCHASED``). The runner's
  ``make_episode(task, handle)`` is ``lambda g, h: WebShopEpisode(g, h, max_steps=...)``.
* ``oracle_replies(goal)`` lists the oracle's assistant turns; ``transcript(goal, backend,
  make_episode)`` plays them into a warm-start transcript (messages) as
  ``oracle.oracle_messages(task, sandbox, make_episode)`` does for terminals. ``tokenizer_texts()`` are the strings every episode repeats (for building a BPE
  tokenizer, like the trainer's terminal list).
* ``off_protocol(transcripts, fraction, seed)`` rewrites a seeded fraction of transcripts'
  replies as JSON tool calls the grammar rejects (the demo's flaw for ES to fix; ``offprotocol``).

``python -m jaxes.envs.check --env webshop --generated N --agent oracle|noop|random|first|replay:FILE``
checks goals at scale (see ``check``). docs/webshop.md has the details.
"""
from __future__ import annotations

from jaxes.envs.webshop import agents, env, generator, reward
from jaxes.envs.webshop.agents import oracle_replies
from jaxes.envs.webshop.catalog import PRODUCT_WINDOW, Catalog, Goal, Product
from jaxes.envs.webshop.offprotocol import off_protocol
from jaxes.envs.webshop.episode import (MAX_STEPS, NOT_PURCHASED, SYSTEM_PROMPT, WebShopBackend,
                                        WebShopEpisode, play)


def make_goals(split: str, n: int, seed: int = 0, start: int = 0, *, data_path: str = "",
               num_products: int = 0, catalog_seed: int = 0, human_goals: bool = True,
               max_steps: int = MAX_STEPS, results_per_page: int = PRODUCT_WINDOW,
               asin_length: int = generator.ASIN_LENGTH) -> list[Goal]:
  """Goals ``start .. start + n - 1`` of ``split``: generated, or from the released files in
  ``data_path``. ``num_products=0``: 1000 generated products, or every released one.
  ``results_per_page``: products per results page (WebShop's 10). ``asin_length``: generated
  product ids' length (WebShop's 10); the released data has its own."""
  if results_per_page < 1:
    raise ValueError(f"webshop goals: results_per_page must be at least 1, got {results_per_page}")
  if data_path:
    from jaxes.envs.webshop import loader
    return loader.goals(data_path, split, n, start, seed=seed, num_products=num_products or None,
                        human_goals=human_goals, results_per_page=results_per_page)
  return generator.goals(split, n, seed, start, num_products=num_products or 1000,
                         catalog_seed=catalog_seed, max_steps=max_steps,
                         results_per_page=results_per_page, asin_length=asin_length)


def transcript(goal: Goal, backend: WebShopBackend, make_episode=None,
               max_steps: int = MAX_STEPS) -> list[dict] | None:
  """The oracle's episode as chat messages, or None if it has no plan or does not pass (the
  counterpart of ``oracle.oracle_messages``). ``make_episode(goal, handle)``: the trainer's
  episode factory (default ``WebShopEpisode(goal, handle, max_steps=max_steps)``)."""
  replies = oracle_replies(goal, max_steps)
  if replies is None:
    return None
  handle = backend.start(goal)
  try:
    episode = (make_episode(goal, handle) if make_episode is not None
               else WebShopEpisode(goal, handle, max_steps=max_steps))
    for reply in replies:
      if episode.step(reply):
        break
    outcome = episode.finish()
  finally:
    handle.close()
  return list(episode.messages) if outcome.passed else None


def tokenizer_texts(max_steps: int = MAX_STEPS) -> list[str]:
  return [SYSTEM_PROMPT.format(max_steps=max_steps), env.PARSE_ERROR_OBSERVATION,
          f"[{env.BACK_TO_SEARCH}]\n[{env.PREV_PAGE}]\n", f"[{env.NEXT_PAGE}]\n",
          "Page 1 (Total results: 50)\n", "Rating: N.A.\n[Description]\n[Features]\n[Buy Now]",
          "WebShop\nInstruction:\n", "\n[Search]", "You have clicked ", "click[Buy Now]",
          "click[Next >]", "search[", "click[", "and price lower than ", " dollars"]


__all__ = ["Catalog", "Goal", "MAX_STEPS", "NOT_PURCHASED", "Product", "SYSTEM_PROMPT",
           "WebShopBackend", "WebShopEpisode", "agents", "env", "generator", "make_goals",
           "off_protocol", "oracle_replies", "play", "reward", "tokenizer_texts", "transcript"]

"""Fixed agents for WebShop: the oracle (warm-start transcripts, the checker), noop, random and
first-result baselines, replay.

The oracle searches with the goal's terms (its attributes and product type), walks the results
pages in order, opens the first product whose best option choice scores r = 1 (it knows the
goal, as the terminal oracle knows the reference solution), clicks those options and buys. Its
plan is played on a real session before it is returned, so a returned plan reaches r = 1.
"""
from __future__ import annotations

import random
import re
from typing import Callable

from jaxes.envs.webshop import reward
from jaxes.envs.webshop.catalog import Goal, Product
from jaxes.envs.webshop.env import (BACK_TO_SEARCH, BUY_NOW, NEXT_PAGE, RESULTS, Action,
                                    WebShopSession, parse_action)

NOOP_REPLY = f"click[{BUY_NOW}]"    # never valid on the search page: noop never buys
_LABEL_RE = re.compile(r"^\[([^\[\]\n]+)\]$", re.MULTILINE)


def oracle_query(goal: Goal) -> str:
  return " ".join([*goal.attributes, goal.query])


def best_options(product: Product, goal: Goal) -> dict[str, str]:
  """For each option of the product, the first value that matches one of the goal's options
  under the reward's rules (options with no matching value stay unchosen)."""
  chosen = {}
  wanted = [reward.normalize_color(o) for o in goal.options]
  for name, values in product.options:
    for value in values:
      v = reward.normalize_color(value)
      hit = v in wanted if name.lower() in reward.EXACT_MATCH_OPTIONS else any(reward.similar(w, v) for w in wanted)
      if hit:
        chosen[name] = value
        break
  return chosen


def oracle_actions(goal: Goal, max_steps: int = 15) -> list[str] | None:
  """The oracle's actions for ``goal`` (a plan verified to reach r = 1 within ``max_steps``),
  or None when it finds no such product on the results pages in time."""
  session = WebShopSession(goal)
  actions = [f"search[{oracle_query(goal)}]"]
  session.step(parse_action(actions[0]))
  while session.page == RESULTS:
    for asin in session.page_asins():
      product = goal.catalog.by_asin[asin]
      chosen = best_options(product, goal)
      if reward.score(product, goal, chosen).reward >= 1.0 - 1e-9:
        plan = actions + [f"click[{asin}]"] + [f"click[{v}]" for v in chosen.values()] + [f"click[{BUY_NOW}]"]
        return plan if len(plan) <= max_steps and _verify(goal, plan) else None
    if NEXT_PAGE.lower() not in session.clickables() or len(actions) + 4 > max_steps:
      return None
    actions.append(f"click[{NEXT_PAGE}]")
    session.step(Action("click", NEXT_PAGE))
  return None


def _verify(goal: Goal, plan: list[str]) -> bool:
  session = WebShopSession(goal)
  for text in plan:
    result = session.step(parse_action(text))
    if not result.valid:
      return False
  return session.purchase is not None and session.purchase.reward >= 1.0 - 1e-9


def oracle_replies(goal: Goal, max_steps: int = 15) -> list[str] | None:
  """The oracle's assistant replies for a warm-start transcript (None: no plan)."""
  return oracle_actions(goal, max_steps)


def labels(observation: str) -> list[str]:
  """The bracketed elements of a page, in order."""
  return _LABEL_RE.findall(observation)


def scripted(replies: list[str]) -> Callable[[list[dict]], str]:
  """Plays ``replies`` in order, then the noop reply."""
  turns = iter(replies)
  return lambda messages: next(turns, NOOP_REPLY)


def noop() -> Callable[[list[dict]], str]:
  return lambda messages: NOOP_REPLY


def random_agent(goal: Goal, seed: int = 0) -> Callable[[list[dict]], str]:
  """Reads only the page: on the search page searches 2-6 random words of the instruction,
  elsewhere clicks a uniformly random element (seeded by goal and seed)."""
  rng = random.Random(f"webshop-random/{seed}/{goal.name}")
  words = goal.instruction.split()

  def act(messages):
    page = messages[-1]["content"]
    options = [label for label in labels(page) if label != "Search"]
    if "[Search]" in page.splitlines():
      return f"search[{' '.join(rng.sample(words, min(len(words), rng.randint(2, 6))))}]"
    return f"click[{rng.choice(options)}]" if options else NOOP_REPLY
  return act


def first_result_agent(goal: Goal) -> Callable[[list[dict]], str]:
  """Searches the whole instruction, opens the first result and buys it without choosing
  options (a baseline that earns partial reward, never full: every goal names options)."""
  def act(messages):
    page = messages[-1]["content"]
    found = labels(page)
    if "Search" in found:
      return f"search[{goal.instruction}]"
    if BUY_NOW in found:
      return f"click[{BUY_NOW}]"
    items = [x for x in found if x not in (BACK_TO_SEARCH, NEXT_PAGE, "< Prev")]
    return f"click[{items[0]}]" if items else f"click[{BACK_TO_SEARCH}]"
  return act

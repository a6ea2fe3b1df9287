"""WebShop's text-mode site as a state machine over one goal: one session per episode.

Pages (Yao et al., 2022, section 3): the search page (instruction and a search box), results
pages (``SEARCH_RETURN_N`` BM25 hits, ``goal.results_per_page`` per page (WebShop's 10), with
< Prev / Next >), item pages (options, title, price, Description / Features, Buy Now) and the
Description and Features sub-pages. Actions are WebShop's grammar: ``search[query]`` (only on the search page)
and ``click[element]`` for an element shown in brackets on the current page (matched without
case, as WebShop lower-cases the argument). Anything else leaves the page as it is and is
answered with a defined observation that starts with ``Invalid action!`` (the string ReAct's
WebShop harness answers with) and repeats the current page.

Pages render like WebShop's simple text mode with one element per line and clickables in
brackets (the layout ReAct's prompts show). A session holds only its own state; the catalog it
reads is immutable, so sessions on one catalog may run in any number of threads.
"""
from __future__ import annotations

import dataclasses
import re

from jaxes.envs.webshop import reward
from jaxes.envs.webshop.catalog import Goal

SEARCH, RESULTS, ITEM, DETAIL, DONE = "search", "results", "item", "detail", "done"
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW = "Back to Search", "Next >", "< Prev", "Buy Now"
DETAILS = ("Description", "Features")
INVALID = "Invalid action!"
PARSE_ERROR_OBSERVATION = (f"{INVALID} Reply with exactly one action: search[QUERY] or "
                           "click[ELEMENT] for an element shown in [brackets].")

_ACTION_RE = re.compile(r"\b(search|click)\[([^\[\]\n]*)\]", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Action:
  name: str       # "search" | "click"
  arg: str


def parse_action(text: str) -> Action | None:
  """The last ``search[...]`` or ``click[...]`` in a model turn (thinking before it is fine)."""
  matches = _ACTION_RE.findall(text)
  if not matches:
    return None
  name, arg = matches[-1]
  return Action(name.lower(), arg.strip())


@dataclasses.dataclass(frozen=True)
class StepResult:
  observation: str
  done: bool
  valid: bool                         # False: the page did not change (invalid action)


class WebShopSession:
  """One episode's browser on ``goal.catalog``; ``close`` is idempotent."""

  def __init__(self, goal: Goal, on_close=None):
    self.goal = goal
    self.catalog = goal.catalog
    self.page = SEARCH
    self.results: tuple[str, ...] = ()
    self.page_no = 1
    self.asin: str | None = None
    self.options: dict[str, str] = {}
    self.detail: str | None = None
    self.purchase: reward.RewardInfo | None = None
    self.closed = False
    self._on_close = on_close

  # -- what the page shows ----------------------------------------------------------------------
  def clickables(self) -> dict[str, tuple]:
    """Lower-cased label -> what clicking it does, for the current page."""
    out: dict[str, tuple] = {}
    if self.page in (RESULTS, ITEM, DETAIL):
      out[BACK_TO_SEARCH.lower()] = ("back",)
    if self.page == RESULTS:
      if self.page_no > 1:
        out[PREV_PAGE.lower()] = ("page", self.page_no - 1)
      if self.page_no * self.goal.results_per_page < len(self.results):
        out[NEXT_PAGE.lower()] = ("page", self.page_no + 1)
      for asin in self.page_asins():
        out[asin.lower()] = ("item", asin)
    elif self.page == ITEM:
      out[PREV_PAGE.lower()] = ("results",)
      for name, values in reversed(self._product().options):   # the first option with a value wins
        for value in values:
          out[value.lower()] = ("option", name, value)
      for detail in DETAILS:
        out[detail.lower()] = ("detail", detail)
      out[BUY_NOW.lower()] = ("buy",)
    elif self.page == DETAIL:
      out[PREV_PAGE.lower()] = ("item_back",)
    return out

  def observation(self) -> str:
    if self.page == SEARCH:
      return f"WebShop\nInstruction:\n{self.goal.instruction}\n[Search]"
    if self.page == RESULTS:
      lines = [f"[{BACK_TO_SEARCH}]",
               f"Page {self.page_no} (Total results: {len(self.results)})"]
      clickable = self.clickables()
      lines += [f"[{label}]" for label in (PREV_PAGE, NEXT_PAGE) if label.lower() in clickable]
      for asin in self.page_asins():
        product = self.catalog.by_asin[asin]
        lines += [f"[{asin}]", product.title, product.price_tag]
      return "\n".join(lines)
    product = self._product()
    if self.page == ITEM:
      lines = [f"[{BACK_TO_SEARCH}]", f"[{PREV_PAGE}]"]
      for name, values in product.options:
        lines.append(f"{name}: " + " ".join(f"[{v}]" for v in values))
      if self.options:
        lines.append("Chosen: " + ", ".join(f"{k}: {v}" for k, v in self.options.items()))
      lines += [product.title, f"Price: {product.price_tag}", "Rating: N.A."]
      lines += [f"[{d}]" for d in DETAILS] + [f"[{BUY_NOW}]"]
      return "\n".join(lines)
    if self.page == DETAIL:
      body = product.description if self.detail == "Description" else "\n".join(product.bullet_points)
      return f"[{BACK_TO_SEARCH}]\n[{PREV_PAGE}]\n{body}"
    return f"Thank you for shopping with us! You bought {self.asin}."

  # -- acting -----------------------------------------------------------------------------------
  def step(self, action: Action | None) -> StepResult:
    """Applies one parsed action (None: the turn did not parse)."""
    if self.page == DONE:
      raise RuntimeError("step() after Buy Now")
    if action is None:
      return self._invalid(PARSE_ERROR_OBSERVATION)
    if action.name == "search":
      if self.page != SEARCH:
        return self._invalid(f"{INVALID} search[...] works only on the search page; "
                             f"click[{BACK_TO_SEARCH}] first.")
      if not action.arg:
        return self._invalid(f"{INVALID} The search query is empty.")
      self.results = self.catalog.search(action.arg.lower())
      self.page, self.page_no = RESULTS, 1
      return StepResult(self.observation(), False, True)
    if self.page == SEARCH:
      return self._invalid(f"{INVALID} The search page has nothing to click; search with search[QUERY].")
    target = self.clickables().get(action.arg.lower())
    if target is None:
      return self._invalid(f"{INVALID} There is no [{action.arg}] to click on this page.")
    kind, *args = target
    prefix = ""
    if kind == "back":
      self.page, self.results, self.asin, self.options = SEARCH, (), None, {}
    elif kind == "page":
      self.page_no = args[0]
    elif kind == "item":
      self.page, self.asin, self.options = ITEM, args[0], {}
    elif kind == "results":
      self.page, self.asin, self.options = RESULTS, None, {}
    elif kind == "option":
      self.options[args[0]] = args[1]
      prefix = f"You have clicked {args[1]}.\n"
    elif kind == "detail":
      self.page, self.detail = DETAIL, args[0]
    elif kind == "item_back":
      self.page = ITEM
    else:  # buy
      self.purchase = reward.score(self._product(), self.goal, dict(self.options))
      self.page = DONE
      return StepResult(self.observation(), True, True)
    return StepResult(prefix + self.observation(), False, True)

  def close(self) -> None:
    if not self.closed:
      self.closed = True
      if self._on_close is not None:
        self._on_close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- helpers ----------------------------------------------------------------------------------
  def _invalid(self, message: str) -> StepResult:
    return StepResult(f"{message}\n\n{self.observation()}", False, False)

  def page_asins(self) -> tuple[str, ...]:
    n = self.goal.results_per_page
    return self.results[(self.page_no - 1) * n:self.page_no * n]

  def _product(self):
    return self.catalog.by_asin[self.asin]

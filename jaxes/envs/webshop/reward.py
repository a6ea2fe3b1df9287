"""WebShop's purchase reward (Yao et al., 2022, "WebShop: Towards Scalable Real-World Web
Interaction with Grounded Language Agents", section 3, "Reward").

For a goal with attributes U_att, options U_opt and price bound u_price, buying product y with
chosen options Y_opt at price y_price scores

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price])
                 / (|U_att| + |U_opt| + 1)

so r ∈ [0, 1] and an episode succeeds iff r = 1. Matching follows the reference
implementation's rules:

* an attribute matches when one of the product's attributes scores above 85 with it by fuzzy
  token-set ratio, or when it is a substring of the title, the features or the description;
* each *chosen* option counts when it equals a goal option (options named "size": exact
  match) or scores above 85 with one (the rest), or is a substring of the product's text; both
  sides pass through ``normalize_color`` first (the first known colour word a value contains);
* r_type, the product-type factor, is 1 when the purchased product shares the goal's query,
  at least two levels of its category path, or more than 20% of the goal title's words — but
  0.5 when none of those holds, 0.1 when under 10% of the title's words are shared, and 0 when
  none is. The reference counts spaCy nouns of the titles; we count the titles' content words
  (lower-cased, no stop words, no numbers), which needs no language model.

The fuzzy ratio is rapidfuzz's ``token_set_ratio`` with its default preprocessing (lower
case, non-alphanumerics to spaces), the same function the reference reaches through thefuzz.
"""
from __future__ import annotations

import dataclasses
import re

from rapidfuzz import fuzz, utils

from jaxes.envs.webshop.catalog import Goal, Product

FUZZY_THRESHOLD = 85          # ratio above which two phrases count as the same
EXACT_MATCH_OPTIONS = ("size",)

# Colour words, alphabetical: normalize_color returns the first one contained in a value
# (our list of common colour names; the released data's own list may differ in a few words).
COLORS = (
    "aqua", "beige", "black", "blue", "blush", "bronze", "brown", "burgundy", "camel",
    "champagne", "charcoal", "chocolate", "coffee", "copper", "coral", "cream", "denim",
    "emerald", "espresso", "fuchsia", "gold", "gray", "green", "grey", "indigo", "ivory",
    "khaki", "lavender", "lilac", "lime", "magenta", "maroon", "mauve", "mint", "mocha",
    "multicolor", "mustard", "navy", "nude", "olive", "orange", "peach", "pink", "plum",
    "purple", "red", "rose", "rust", "sand", "silver", "tan", "taupe", "teal", "turquoise",
    "violet", "walnut", "white", "wine", "yellow",
)

_TITLE_STOP = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "into", "is", "it",
    "of", "on", "or", "the", "to", "with", "without", "x", "pack", "count", "set", "pcs"))
_WORD_RE = re.compile(r"[a-z]+")


@dataclasses.dataclass(frozen=True)
class RewardInfo:
  reward: float
  r_type: float
  attribute_matches: int
  option_matches: int
  price_ok: bool


def normalize_color(value: str) -> str:
  for color in COLORS:
    if color in value:
      return color
  return value


def similar(a: str, b: str) -> bool:
  return fuzz.token_set_ratio(a, b, processor=utils.default_process) > FUZZY_THRESHOLD


def title_words(title: str) -> set[str]:
  return {w for w in _WORD_RE.findall(title.lower()) if w not in _TITLE_STOP}


def type_factor(product: Product, goal: Goal) -> float:
  query_match = product.query == goal.query
  levels = lambda path: {level.strip() for level in path.split("›")}
  category_match = len(levels(product.product_category) & levels(goal.product_category)) >= 2
  wanted = title_words(goal.product_name)
  title_score = len(title_words(product.title) & wanted) / len(wanted) if wanted else 0.2
  if title_score == 0.0:
    return 0.0
  if title_score < 0.1:
    return 0.1
  return 1.0 if (query_match or category_match or title_score > 0.2) else 0.5


def _product_text(product: Product) -> tuple[str, str, str]:
  return product.title.lower(), " ".join(product.bullet_points).lower(), product.description.lower()


def attribute_matches(product: Product, goal: Goal) -> int:
  texts = _product_text(product)
  count = 0
  for wanted in goal.attributes:
    if any(similar(have, wanted) for have in product.attributes) or any(wanted in t for t in texts):
      count += 1
  return count


def option_matches(product: Product, goal: Goal, chosen: dict[str, str]) -> int:
  """Counts chosen options (option name -> value) that match the goal's options."""
  wanted = [normalize_color(o) for o in goal.options]
  texts = _product_text(product)
  count = 0
  for name, value in chosen.items():
    value = normalize_color(value)
    if name.lower() in EXACT_MATCH_OPTIONS:
      matched = value in wanted
    else:
      matched = any(similar(w, value) for w in wanted)
    if matched or any(value in t for t in texts):
      count += 1
  return count


def score(product: Product, goal: Goal, chosen: dict[str, str], price: float | None = None) -> RewardInfo:
  """The reward for buying ``product`` with ``chosen`` options at ``price`` (default: its price)."""
  price = product.price if price is None else price
  r_type = type_factor(product, goal)
  n_att = attribute_matches(product, goal)
  # The reference can count more chosen options than the goal has (r > 1); we cap at |U_opt|.
  n_opt = min(option_matches(product, goal, chosen), len(goal.options))
  price_ok = goal.price_upper <= 0 or price <= goal.price_upper
  total = (n_att + n_opt + int(price_ok)) / (len(goal.attributes) + len(goal.options) + 1)
  return RewardInfo(reward=r_type * total, r_type=r_type, attribute_matches=n_att,
                    option_matches=n_opt, price_ok=price_ok)

"""The released WebShop files (Yao et al., 2022) as a catalog and goals, for users who have them.

A data folder holds the files WebShop's setup script downloads (nothing is downloaded here):

  items_shuffle_1000.json  (or items_shuffle.json)  a JSON list of scraped products: asin,
                           name, full_description, small_description, pricing ("$x" or a
                           "$x - $y" range), customization_options ({name: [{"value": ...}]}),
                           category, query, product_category
  items_ins_v2_1000.json   (or items_ins_v2.json)    {asin: {"attributes": [...],
                           "instruction": ..., "instruction_attributes": [...]}}
  items_human_ins.json     {asin: [{"instruction": ..., "instruction_attributes": [...],
                           "instruction_options": [...]}, ...]} (human instructions)

Products are cleaned as WebShop's loader does: ASINs that are "nan" or longer than 10
characters and repeated ASINs are skipped; option values are lower-cased with "/" shown as
" | "; a product without attributes gets ["DUMMY_ATTR"]; a price range's price is drawn
uniformly inside it (here from a seed per ASIN, where WebShop uses the unseeded global RNG); no
pricing means $100. Goals: human instructions with at least one attribute (or, with
``human_goals=False``, the synthetic instruction of each product with every combination of its
options), the price bound by WebShop's rule, then shuffled with ``random.Random(233)`` as WebShop
shuffles them, so goal *i* is the reference's goal *i*: the first 500 are the test split
("heldout"), the next 1000 "dev", the rest "train" (the split of WebShop's baselines). Price bounds
come from ``seed``, so they differ from a given reference run's.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import random
import re

from jaxes.envs.webshop.catalog import PRODUCT_WINDOW, Catalog, Goal, Product
from jaxes.envs.webshop.generator import price_bound

SPLIT_RANGES = {"heldout": (0, 500), "dev": (500, 1500), "train": (1500, None)}
PRODUCT_FILES = ("items_shuffle_1000.json", "items_shuffle.json")
ATTRIBUTE_FILES = ("items_ins_v2_1000.json", "items_ins_v2.json")
HUMAN_FILE = "items_human_ins.json"
GOAL_SHUFFLE_SEED = 233


def _find(data_path: str, names: tuple[str, ...], required: bool = True) -> str | None:
  for name in names:
    path = os.path.join(data_path, name)
    if os.path.isfile(path):
      return path
  if required:
    raise FileNotFoundError(f"webshop data: none of {', '.join(names)} in {data_path}")
  return None


def _read_json(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"webshop data: cannot read {path}: {e}") from None


def _pricing(text) -> list[float]:
  if not text:
    return [100.0]
  values = [float(re.sub(r"[^\d.]", "", part)) for part in str(text).split("$")[1:]
            if re.sub(r"[^\d.]", "", part)]
  return values[:2] or [100.0]


def _product(raw: dict, attributes: dict, seed: int) -> Product:
  asin = raw["asin"]
  pricing = _pricing(raw.get("pricing"))
  if len(pricing) == 1:
    price, tag = pricing[0], f"${pricing[0]}"
  else:
    price, tag = random.Random(f"webshop-price/{seed}/{asin}").uniform(*pricing), f"${pricing[0]} to ${pricing[1]}"
  options = []
  for name, contents in (raw.get("customization_options") or {}).items():
    if contents is None:
      continue
    values = tuple(c["value"].strip().replace("/", " | ").lower() for c in contents)
    options.append((name.lower(), values))
  bullets = raw.get("small_description") or []
  bullets = tuple(bullets) if isinstance(bullets, list) else (bullets,)
  attrs = attributes.get(asin, {}).get("attributes") or ["DUMMY_ATTR"]
  return Product(asin=asin, title=raw.get("name") or "", query=(raw.get("query") or "").lower().strip(),
                 category=raw.get("category") or "", product_category=raw.get("product_category") or "",
                 price=float(price), price_tag=tag, options=tuple(options), attributes=tuple(attrs),
                 description=raw.get("full_description") or "", bullet_points=bullets)


@functools.lru_cache(maxsize=4)
def load(data_path: str, num_products: int | None = None, seed: int = 0,
         human_goals: bool = True) -> tuple[Catalog, tuple[dict, ...]]:
  """The catalog and every goal (as plain dicts, in WebShop's shuffled order)."""
  data_path = os.path.abspath(data_path)
  raw_products = _read_json(_find(data_path, PRODUCT_FILES))
  attributes = _read_json(_find(data_path, ATTRIBUTE_FILES))
  human = _read_json(_find(data_path, (HUMAN_FILE,))) if human_goals else {}
  if not isinstance(raw_products, list) or not isinstance(attributes, dict) or not isinstance(human, dict):
    raise ValueError(f"webshop data in {data_path}: expected a list of products and objects "
                     "keyed by ASIN for the attribute and instruction files")
  if num_products is not None:
    raw_products = raw_products[:num_products]
  products, seen = [], set()
  for raw in raw_products:
    asin = raw.get("asin")
    if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
      continue
    seen.add(asin)
    products.append(_product(raw, attributes, seed))
  catalog = Catalog(products, name=f"webshop:{data_path}")

  goals = []
  for product in products:
    rng = random.Random(f"webshop-bound/{seed}/{product.asin}")
    if human_goals:
      wanted = [(i["instruction"].strip("."), i["instruction_attributes"], i.get("instruction_options") or [])
                for i in human.get(product.asin, []) if i.get("instruction_attributes")]
    else:
      entry = attributes.get(product.asin, {})
      if not entry.get("instruction"):
        continue
      wanted = []
      names = sorted(dict(product.options))
      for combo in itertools.product(*(dict(product.options)[n] for n in names)):
        text = ", and ".join(f"{n}: {v}" for n, v in zip(names, combo))
        wanted.append((entry["instruction"] + (f" with {text}" if text else ""),
                       entry["instruction_attributes"], list(combo)))
    for text, attrs, options in wanted:
      bound = price_bound(product.price, rng)
      if isinstance(options, dict):
        options = list(options.values())
      goals.append({"asin": product.asin, "attributes": tuple(attrs), "options": tuple(options),
                    "instruction": text + (f", and price lower than {bound:.2f} dollars" if bound else ""),
                    "price_upper": bound if bound is not None else 1e6})
  random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
  return catalog, tuple(goals)


def goals(data_path: str, split: str, n: int, start: int = 0, *, seed: int = 0,
          num_products: int | None = None, human_goals: bool = True,
          results_per_page: int = PRODUCT_WINDOW) -> list[Goal]:
  """Goals ``start .. start + n - 1`` of a split of the released data."""
  if split not in SPLIT_RANGES:
    raise ValueError(f"webshop goals: split must be one of {tuple(SPLIT_RANGES)}, got {split!r}")
  catalog, all_goals = load(data_path, num_products, seed, human_goals)
  lo, hi = SPLIT_RANGES[split]
  pool = all_goals[lo:hi]
  if start + n > len(pool):
    raise ValueError(f"webshop goals: the {split} split of {data_path} has {len(pool)} goals; "
                     f"asked for {start}..{start + n - 1}")
  out = []
  for i, g in enumerate(pool[start:start + n], start):
    product = catalog.by_asin[g["asin"]]
    out.append(Goal(name=f"webshop-{split}-{i}", instruction=g["instruction"], asin=g["asin"],
                    query=product.query, category=product.category,
                    product_category=product.product_category, product_name=product.title,
                    attributes=g["attributes"], options=g["options"], price_upper=g["price_upper"],
                    catalog=catalog, split=split, results_per_page=results_per_page))
  return out

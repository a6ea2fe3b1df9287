"""Products, goals, and a catalog searchable by BM25 (the read-only world every episode shares).

Fields follow the released WebShop data after its loader's clean-up (Yao et al., 2022):
``Title``, ``Description``, ``BulletPoints`` (the Features page), ``Attributes``, ``options``
(option name -> values, lower case), ``query`` (the search query the product was scraped for,
which is its product type), ``product_category`` (levels joined by " › "). Search ranks products
with BM25 over the same text WebShop's Lucene index holds (title, description, first bullet
point, options), by ``bm25s`` instead of pyserini (no Java needed); queries and documents are
lower-cased words without English stop words (no stemming, unlike Lucene's default analyzer).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

SEARCH_RETURN_N = 50       # results kept per search, as WebShop's engine
PRODUCT_WINDOW = 10        # results per page, as WebShop's engine

_WORD_RE = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
  """Lower-cased alphanumeric words (the tokenizer of both the index and queries)."""
  from bm25s.stopwords import STOPWORDS_EN
  return [w for w in _WORD_RE.findall(text.lower()) if w not in STOPWORDS_EN]


@dataclasses.dataclass(frozen=True)
class Product:
  asin: str
  title: str
  query: str                          # product type (the query it was collected for)
  category: str                       # top-level category (beauty, fashion, ...)
  product_category: str               # "A › B › C"
  price: float                        # the price the reward compares with the goal's bound
  price_tag: str                      # what the pages show ("$12.99", "$10.0 to $15.0")
  options: tuple[tuple[str, tuple[str, ...]], ...]   # (name, values) in page order
  attributes: tuple[str, ...]
  description: str
  bullet_points: tuple[str, ...]

  def option_dim(self, value: str) -> str | None:
    """The option whose values include ``value`` (the first one; values are matched lower-case)."""
    for name, values in self.options:
      if value in values:
        return name
    return None

  def search_text(self) -> str:
    options = ", and ".join(f"{name}: {', '.join(values)}" for name, values in self.options)
    bullet = self.bullet_points[0] if self.bullet_points else ""
    return " ".join([self.title, self.description, bullet, options])


@dataclasses.dataclass(frozen=True, eq=False)
class Goal:
  """One shopping instruction. ``name`` is unique within a split; ``catalog`` is the world the
  goal lives in (``WebShopBackend.start(goal)`` opens a session on it)."""
  name: str
  instruction: str
  asin: str                           # the product the instruction was written for
  query: str
  category: str
  product_category: str
  product_name: str                   # the target's title (for the product-type factor)
  attributes: tuple[str, ...]
  options: tuple[str, ...]            # goal option values
  price_upper: float
  catalog: "Catalog" = dataclasses.field(repr=False)
  split: str = "train"
  # Results shown per page: WebShop's 10 by default. A smaller page shortens every transcript
  # (a results page is most of an episode's tokens), which is what a CPU-sized model can afford.
  results_per_page: int = PRODUCT_WINDOW


class Catalog:
  """Immutable after construction: ``search`` only reads, so any number of threads may share one."""

  def __init__(self, products, name: str):
    import bm25s   # imported here: it imports (and initializes) JAX at import time
    self.name = name
    self.products: tuple[Product, ...] = tuple(products)
    if not self.products:
      raise ValueError(f"catalog {name!r} has no products")
    self.by_asin = {p.asin: p for p in self.products}
    if len(self.by_asin) != len(self.products):
      raise ValueError(f"catalog {name!r} has duplicate ASINs")
    self._bm25 = bm25s.BM25()
    self._bm25.index([words(p.search_text()) or [""] for p in self.products], show_progress=False)
    self._vocab = frozenset(self._bm25.vocab_dict)

  def search(self, query: str, k: int = SEARCH_RETURN_N) -> tuple[str, ...]:
    """ASINs of the ``k`` best BM25 matches with a positive score; ties keep catalog order."""
    tokens = [w for w in words(query) if w in self._vocab]
    if not tokens:
      return ()
    scores = np.asarray(self._bm25.get_scores(tokens))
    hits = np.flatnonzero(scores > 0)
    if len(hits) > k:   # keep the top k and everything tied with the k-th, then sort only those
      kth = np.partition(scores[hits], len(hits) - k)[len(hits) - k]
      hits = hits[scores[hits] >= kth]
    order = hits[np.lexsort((hits, -scores[hits]))][:k]
    return tuple(self.products[i].asin for i in order)

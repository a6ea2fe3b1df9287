"""A procedural WebShop catalog and its shopping goals, deterministic from seeds, so CPU runs,
tests and CI need no download.

The catalog has WebShop's five top-level categories, a handful of product types each (the
type is the product's ``query``, as in the scraped data), per-category attribute pools (each
product has 3-5 attributes; its title names two, its Features page all of them) and option
dimensions (each product offers a subset of every dimension's values), and a price drawn from
the type's range. Goals are written like WebShop's synthetic instructions: a product type, 1-3
of the target's attributes, one value per option and a price bound, e.g. "i am looking for
noise cancelling wireless earbuds with color: black, and style: ultra, and price lower than
60.00 dollars". The bound is WebShop's rule: two of the next four multiples of ten above the
target's price, the larger one.

Train and held-out goals never share a target product: each product belongs to one split
(``zlib.crc32(asin) % 5 == 0``: held-out, about a fifth). A goal is kept only if the oracle
(``agents.oracle_actions``) reaches r = 1 on it within the step limit; otherwise it is redrawn
from the same seeded stream, so every generated goal is solvable.

Every catalog is validated when built: within a category, no two attribute phrases or option
values count as the same under the reward's fuzzy match, and no product's text contains an
attribute it does not have or any option value (the reward credits substrings of the text), so
the reward measures exactly the product's listed attributes and the options chosen.
"""
from __future__ import annotations

import functools
import itertools
import random
import zlib

from jaxes.envs.webshop import reward
from jaxes.envs.webshop.catalog import PRODUCT_WINDOW, Catalog, Goal, Product

SPLITS = ("train", "heldout")
HELDOUT_BUCKET = 5           # crc32(asin) % 5 == 0: held-out target
ASIN_LENGTH = 10             # WebShop's ASINs: "B0" and 8 characters
ASIN_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"

# category -> (product types with price ranges, attribute pool, option dimensions)
CATEGORIES = {
    "beauty": (
        {"shampoo": (6, 30), "conditioner": (6, 30), "lipstick": (5, 25), "face serum": (12, 60),
         "moisturizer": (8, 45), "sunscreen": (7, 35), "body wash": (5, 20)},
        ("paraben free", "cruelty free", "sulfate free", "long lasting", "dry skin",
         "sensitive skin", "natural ingredients", "fragrance free", "anti aging", "vegan formula",
         "dermatologist tested", "oil control"),
        (("scent", ("lavender", "coconut", "vanilla", "citrus", "eucalyptus", "unscented")),
         ("size", ("mini", "regular", "value pack", "jumbo"))),
    ),
    "fashion": (
        {"sneakers": (30, 120), "hoodie": (20, 70), "jeans": (25, 90), "dress": (20, 110),
         "jacket": (40, 190), "socks": (6, 25), "sandals": (15, 60)},
        ("machine wash", "long sleeve", "short sleeve", "slim fit", "relaxed fit", "cotton blend",
         "button closure", "elastic waist", "water resistant", "non slip", "quick drying",
         "breathable fabric", "rubber sole"),
        (("color", ("black", "white", "navy", "gray", "burgundy", "olive", "khaki", "pink")),
         ("size", ("x-small", "small", "medium", "large", "x-large", "xx-large"))),
    ),
    "grocery": (
        {"coffee beans": (8, 40), "green tea": (4, 25), "protein bars": (10, 45),
         "trail mix": (5, 25), "olive oil": (8, 45), "dark chocolate": (4, 30), "granola": (4, 20)},
        ("gluten free", "non gmo", "organic", "sugar free", "low calorie", "keto friendly",
         "high protein", "kosher certified", "individually wrapped", "no artificial flavors",
         "plant based", "dairy free"),
        (("flavor", ("original", "caramel", "hazelnut", "honey", "cinnamon", "salted")),
         ("size", ("pack of 2", "pack of 4", "pack of 6", "pack of 12"))),
    ),
    "furniture": (
        {"bookshelf": (40, 250), "office chair": (60, 400), "coffee table": (50, 300),
         "bar stool": (30, 180), "nightstand": (35, 200), "tv stand": (60, 350), "shoe rack": (15, 90)},
        ("easy assembly", "solid wood", "metal frame", "storage space", "living room",
         "space saving", "height adjustable", "lumbar support", "mid century", "engineered wood",
         "anti tip", "padded seat"),
        (("color", ("walnut", "white", "black", "espresso", "gray", "natural oak")),
         ("style", ("modern", "rustic", "industrial", "farmhouse"))),
    ),
    "electronics": (
        {"bluetooth speaker": (20, 150), "wireless earbuds": (20, 200), "phone charger": (8, 40),
         "usb cable": (5, 25), "power bank": (15, 80), "smart watch": (40, 300), "keyboard": (20, 150)},
        ("fast charging", "noise cancelling", "long battery life", "waterproof design",
         "easy to carry", "high definition", "wireless charging", "type c port", "hands free",
         "compact design", "voice assistant", "led indicator"),
        (("color", ("black", "white", "silver", "navy", "coral")),
         ("style", ("basic", "plus", "ultra"))),
    ),
}

TYPES = tuple((category, ptype) for category, (types, _, _) in CATEGORIES.items() for ptype in types)

_LEADS = ("i am looking for", "i need", "i want to buy", "find me", "i'm searching for",
          "please help me find", "i would like")
_FILLERS = ("made for everyday use", "a customer favorite", "checked for quality",
            "built to hold up well", "simple to care for", "a good value")
_SYLLABLES = ("ko", "va", "zu", "mi", "te", "lo", "ra", "ni", "qu", "fe", "xo", "sa", "bi", "do")


def _banned(category: str) -> tuple[str, ...]:
  """Phrases a product's free text must not contain (the reward credits substrings)."""
  _, attributes, dims = CATEGORIES[category]
  values = {reward.normalize_color(v) for _, vs in dims for v in vs} | {v for _, vs in dims for v in vs}
  return tuple(attributes) + tuple(values)


def _brand(rng: random.Random, banned: tuple[str, ...]) -> str:
  while True:
    name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
    if not any(b in name for b in banned):
      return name.capitalize()


def _product(i: int, seed: int, asin_length: int, taken: set) -> Product:
  rng = random.Random(f"webshop-product/{seed}/{i}")
  category, ptype = TYPES[i % len(TYPES)]
  types, attribute_pool, dims = CATEGORIES[category]
  brand = _brand(rng, _banned(category))
  attributes = tuple(rng.sample(attribute_pool, rng.randint(3, 5)))
  options = []
  for name, values in dims:
    offered = set(rng.sample(values, rng.randint(2, len(values))))
    options.append((name, tuple(v for v in values if v in offered)))
  options = tuple(options)
  lo, hi = types[ptype]
  price = round(round(rng.uniform(lo, hi)) - 0.01, 2)
  # All 8 characters are drawn at every length, so the rest of the product does not depend on it;
  # a short id is their prefix, and only short ids collide: redrawn from a stream of their own.
  asin = "B0" + "".join(rng.choice(ASIN_ALPHABET) for _ in range(ASIN_LENGTH - 2))[:asin_length - 2]
  redraw = random.Random(f"webshop-asin/{seed}/{i}")
  while asin in taken:
    asin = "B0" + "".join(redraw.choice(ASIN_ALPHABET) for _ in range(asin_length - 2))
  taken.add(asin)
  title = f"{brand} {ptype.title()} - {attributes[0].title()}, {attributes[1].title()}"
  bullets = tuple(f"{a.capitalize()}: {rng.choice(_FILLERS)}" for a in attributes)
  description = (f"The {brand} {ptype} is {rng.choice(_FILLERS)}. "
                 f"Sold by {brand}; see the options above for every variant.")
  return Product(asin=asin, title=title, query=ptype, category=category,
                 product_category=f"{category.title()} › {ptype.title()}", price=price,
                 price_tag=f"${price:.2f}", options=options, attributes=attributes,
                 description=description, bullet_points=bullets)


def validate(products) -> None:
  """Raises ValueError when the vocabulary would let the reward credit the wrong thing."""
  for category, (_, attributes, dims) in CATEGORIES.items():
    clashes = [(a, b) for a, b in itertools.combinations(attributes, 2) if reward.similar(a, b)]
    values = [(name, v) for name, vs in dims for v in vs]
    for (dim_a, a), (dim_b, b) in itertools.combinations(values, 2):
      exact = dim_a == dim_b and dim_a in reward.EXACT_MATCH_OPTIONS   # compared exactly
      if reward.normalize_color(a) == reward.normalize_color(b) or (not exact and reward.similar(a, b)):
        clashes.append((a, b))
    if clashes:
      raise ValueError(f"webshop generator: {clashes[0][0]!r} and {clashes[0][1]!r} ({category}) "
                       "match each other")
  for p in products:
    text = " ".join([p.title, p.description, *p.bullet_points]).lower()
    for phrase in _banned(p.category):
      if phrase in text and phrase not in p.attributes:
        raise ValueError(f"webshop generator: {p.asin}'s text contains {phrase!r}")


def product_split(asin: str) -> str:
  return "heldout" if zlib.crc32(asin.encode()) % HELDOUT_BUCKET == 0 else "train"


@functools.lru_cache(maxsize=8)
def catalog(num_products: int = 1000, seed: int = 0, asin_length: int = ASIN_LENGTH) -> Catalog:
  """The generated catalog (one shared, read-only instance per argument tuple). ``asin_length``:
  characters per product id, "B0" included, at most WebShop's 10; a shorter id is easier for a
  tiny model to copy from the results page (configs/demo_webshop.py)."""
  if num_products < 2 * len(TYPES):
    raise ValueError(f"webshop catalog: num_products must be at least {2 * len(TYPES)}, got {num_products}")
  if not 3 <= asin_length <= ASIN_LENGTH:
    raise ValueError(f"webshop catalog: asin_length must be in [3, {ASIN_LENGTH}], got {asin_length}")
  ids = len(ASIN_ALPHABET) ** (asin_length - 2)
  if ids < 2 * num_products:
    raise ValueError(f"webshop catalog: asin_length {asin_length} gives {ids} ids, fewer than twice "
                     f"num_products ({num_products}); use a longer id")
  taken: set = set()
  products = [_product(i, seed, asin_length, taken) for i in range(num_products)]
  validate(products)
  suffix = "" if asin_length == ASIN_LENGTH else f"-id{asin_length}"
  return Catalog(products, name=f"generated-{num_products}-{seed}{suffix}")


def price_bound(price: float, rng: random.Random) -> float | None:
  """WebShop's rule: the larger of two of the next four multiples of 10 above the price."""
  above = [10.0 * k for k in range(1, 100) if 10.0 * k > price][:4]
  return max(rng.sample(above, 2)) if len(above) >= 2 else None


def _instruction(rng: random.Random, product: Product, attributes, options: dict, bound) -> str:
  attrs = " and ".join(attributes)
  body = (f"{attrs} {product.query}" if rng.random() < 0.5 else f"{product.query} that is {attrs}")
  text = f"{rng.choice(_LEADS)} {body}"
  if options:
    text += " with " + ", and ".join(f"{k}: {v}" for k, v in options.items())
  if bound is not None:
    text += f", and price lower than {bound:.2f} dollars"
  return text


def _draw_goal(rng: random.Random, cat: Catalog, targets, name: str, split: str,
               results_per_page: int) -> Goal:
  product = rng.choice(targets)
  attributes = tuple(rng.sample(product.attributes, rng.randint(1, min(3, len(product.attributes)))))
  options = {dim: rng.choice(values) for dim, values in product.options}
  bound = price_bound(product.price, rng)
  return Goal(name=name, instruction=_instruction(rng, product, attributes, options, bound),
              asin=product.asin, query=product.query, category=product.category,
              product_category=product.product_category, product_name=product.title,
              attributes=attributes, options=tuple(options.values()),
              price_upper=bound if bound is not None else 1e6, catalog=cat, split=split,
              results_per_page=results_per_page)


def goals(split: str, n: int, seed: int = 0, start: int = 0, *, num_products: int = 1000,
          catalog_seed: int = 0, max_steps: int = 15, results_per_page: int = PRODUCT_WINDOW,
          asin_length: int = ASIN_LENGTH) -> list[Goal]:
  """Goals ``start .. start + n - 1`` of a split; goal i is a pure function of (split, i, seed,
  num_products, catalog_seed, asin_length, max_steps, results_per_page): the last two decide
  which draws the oracle solves in time."""
  from jaxes.envs.webshop import agents
  if split not in SPLITS:
    raise ValueError(f"webshop goals: split must be one of {SPLITS}, got {split!r}")
  cat = catalog(num_products, catalog_seed, asin_length)
  targets = [p for p in cat.products if product_split(p.asin) == split]
  out = []
  for i in range(start, start + n):
    rng = random.Random(f"webshop-goal/{seed}/{split}/{i}")
    for _attempt in range(100):
      goal = _draw_goal(rng, cat, targets, f"webshop-{split}-{seed}-{i}", split, results_per_page)
      if agents.oracle_actions(goal, max_steps) is not None:
        break
    else:
      raise RuntimeError(f"webshop goals: no solvable goal for {split}/{i} in 100 draws")
    out.append(goal)
  return out

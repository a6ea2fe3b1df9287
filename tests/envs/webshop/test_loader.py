"""The released WebShop files: a small data set in their format, written here."""
import json
import random

import pytest

from jaxes.envs.webshop import WebShopBackend, agents, loader, make_goals, play


def raw_product(asin, name, query, pricing, options, category="beauty"):
  return {"asin": asin, "name": name, "query": query, "category": category,
          "product_category": f"Beauty & Personal Care › Hair Care › {query.title()}",
          "full_description": f"{name}. A full description.", "small_description": [f"About {name}"],
          "pricing": pricing, "images": ["http://img/1.jpg"], "brand": "x",
          "customization_options": options}


@pytest.fixture()
def data_dir(tmp_path):
  products = [
      raw_product("B000000001", "Argan Oil Shampoo for Dry Hair", "Shampoo ", "$12.99",
                  {"Size": [{"value": "8 Fl Oz", "image": None}, {"value": "16 Fl Oz", "image": None}],
                   "Scent": [{"value": "Lavender/Mint", "image": None}], "Color": None}),
      raw_product("B000000002", "Volumizing Shampoo, Sulfate Free", "shampoo", "$7.50 - $15.00", {}),
      raw_product("B000000001", "duplicate asin", "shampoo", "$1.00", {}),
      raw_product("nan", "no asin", "shampoo", "$1.00", {}),
      raw_product("B0000000030", "asin too long", "shampoo", "$1.00", {}),
      raw_product("B000000004", "Leather Wallet for Men", "wallet", "", {}, category="fashion"),
  ]
  attributes = {"B000000001": {"attributes": ["dry hair", "argan oil"], "instruction": "i want argan shampoo",
                               "instruction_attributes": ["argan oil"]},
                "B000000002": {"attributes": ["sulfate free"]}}
  human = {"B000000001": [
               {"instruction": "i need an argan oil shampoo for dry hair, 16 fl oz.",
                "instruction_attributes": ["argan oil", "dry hair"], "instruction_options": ["16 fl oz"]},
               {"instruction": "skipped: no attributes", "instruction_attributes": [],
                "instruction_options": []}],
           "B000000002": [{"instruction": "a sulfate free shampoo", "instruction_attributes": ["sulfate free"],
                           "instruction_options": []}],
           "B000000004": [{"instruction": "a leather wallet", "instruction_attributes": ["leather"],
                           "instruction_options": {"color": "brown"}}]}
  (tmp_path / "items_shuffle_1000.json").write_text(json.dumps(products))
  (tmp_path / "items_ins_v2_1000.json").write_text(json.dumps(attributes))
  (tmp_path / "items_human_ins.json").write_text(json.dumps(human))
  return tmp_path


def test_products_are_cleaned_like_webshop(data_dir):
  catalog, goals = loader.load(str(data_dir))
  assert [p.asin for p in catalog.products] == ["B000000001", "B000000002", "B000000004"]
  shampoo, volume, wallet = catalog.products
  assert shampoo.options == (("size", ("8 fl oz", "16 fl oz")), ("scent", ("lavender | mint",)))
  assert shampoo.query == "shampoo" and shampoo.price == 12.99 and shampoo.price_tag == "$12.99"
  assert 7.5 <= volume.price <= 15.0 and volume.price_tag == "$7.5 to $15.0"
  assert wallet.price == 100.0 and wallet.attributes == ("DUMMY_ATTR",)
  assert shampoo.bullet_points == ("About Argan Oil Shampoo for Dry Hair",)
  # human goals: instructions with attributes only, shuffled as WebShop shuffles them
  texts = [g["instruction"].split(", and price")[0] for g in goals]
  expected = ["i need an argan oil shampoo for dry hair, 16 fl oz", "a sulfate free shampoo", "a leather wallet"]
  random.Random(233).shuffle(expected)
  assert texts == expected
  by_asin = {g["asin"]: g for g in goals}
  assert by_asin["B000000004"]["options"] == ("brown",)          # a dict of options: its values
  bound = by_asin["B000000001"]["price_upper"]
  assert bound in (30.0, 40.0, 50.0) and f"price lower than {bound:.2f} dollars" in by_asin["B000000001"]["instruction"]


def test_released_goals_play_and_score(data_dir):
  goals = make_goals("heldout", 3, data_path=str(data_dir))
  assert [g.name for g in goals] == ["webshop-heldout-0", "webshop-heldout-1", "webshop-heldout-2"]
  g = next(g for g in goals if g.asin == "B000000001")
  actions = agents.oracle_actions(g)
  assert actions is not None
  out, _ = play(WebShopBackend(), g, agents.scripted(actions))
  assert out.passed and out.reward == 1.0
  assert make_goals("heldout", 3, data_path=str(data_dir))[0].price_upper == goals[0].price_upper


def test_synthetic_goals_enumerate_option_combinations(data_dir):
  _, goals = loader.load(str(data_dir), human_goals=False)
  assert sorted(g["instruction"].split(", and price")[0] for g in goals) == [
      "i want argan shampoo with scent: lavender | mint, and size: 16 fl oz",
      "i want argan shampoo with scent: lavender | mint, and size: 8 fl oz"]


def test_missing_or_bad_files_are_one_line_errors(tmp_path, data_dir):
  with pytest.raises(FileNotFoundError, match="items_shuffle"):
    make_goals("train", 1, data_path=str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match="has 0 goals"):
    make_goals("train", 1, data_path=str(data_dir))
  with pytest.raises(ValueError, match="split"):
    make_goals("validation", 1, data_path=str(data_dir))
  (data_dir / "items_human_ins.json").write_text("{not json")
  loader.load.cache_clear()
  with pytest.raises(ValueError, match="cannot read"):
    make_goals("heldout", 1, data_path=str(data_dir))

"""WebShop: the reward on hand-worked cases, pages and invalid actions, agents, determinism,
threads, the checker."""
import concurrent.futures as cf
import dataclasses
import json

import pytest

from jaxes.envs import check as envs_check
from jaxes.envs import protocol
from jaxes.envs.webshop import agents, env, generator, make_goals, reward, transcript
from jaxes.envs.webshop import check as webshop_check
from jaxes.envs.webshop.catalog import Goal, Product
from jaxes.envs.webshop.episode import WebShopBackend, WebShopEpisode, play


def product(**kw):
  base = dict(asin="B000000001", title="Kova Wireless Earbuds - Noise Cancelling, Fast Charging",
              query="wireless earbuds", category="electronics",
              product_category="Electronics › Wireless Earbuds", price=40.0, price_tag="$40.00",
              options=(("color", ("black", "white")), ("size", ("small", "x-large"))),
              attributes=("noise cancelling", "fast charging", "machine wash"),
              description="Plain text.", bullet_points=("Good.",))
  base.update(kw)
  return Product(**base)


def goal(**kw):
  base = dict(name="g", instruction="...", asin="B000000001", query="wireless earbuds",
              category="electronics", product_category="Electronics › Wireless Earbuds",
              product_name="Kova Wireless Earbuds - Noise Cancelling, Fast Charging",
              attributes=("noise cancelling", "long battery life"), options=("black",),
              price_upper=50.0, catalog=None)
  base.update(kw)
  return Goal(**base)


# -- reward: r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[price <= bound]) / (|U_att| + |U_opt| + 1)
def test_reward_one_of_two_attributes_option_and_price():
  # attributes: "noise cancelling" yes, "long battery life" no -> 1; option black -> 1; 40 <= 50 -> 1
  info = reward.score(product(), goal(), {"color": "black"})
  assert (info.attribute_matches, info.option_matches, info.price_ok, info.r_type) == (1, 1, True, 1.0)
  assert info.reward == pytest.approx(3 / 4)


def test_reward_over_budget_and_wrong_option():
  info = reward.score(product(price=60.0), goal(), {"color": "white"})
  assert info.reward == pytest.approx(1 / 4)          # only "noise cancelling"


def test_reward_full_match_is_one():
  g = goal(attributes=("noise cancelling", "fast charging"), options=("black", "small"))
  assert reward.score(product(), g, {"color": "black", "size": "small"}).reward == 1.0
  # without choosing options: (2 + 0 + 1) / 5
  assert reward.score(product(), g, {}).reward == pytest.approx(3 / 5)


def test_reward_fuzzy_attributes_and_exact_sizes():
  # token_set_ratio("machine wash", "machine washable") = 85.7 > 85: a match
  g = goal(attributes=("machine washable",), options=("large",))
  assert reward.attribute_matches(product(), g) == 1
  # "x-large" is fuzzily identical to "large" but sizes compare exactly
  assert reward.option_matches(product(), g, {"size": "x-large"}) == 0
  assert reward.option_matches(product(), goal(options=("jet black",)), {"color": "black"}) == 1  # colour normalised


def test_reward_attribute_found_in_text():
  p = product(description="Rated for long battery life.")
  assert reward.attribute_matches(p, goal()) == 2


def test_reward_product_type_factor():
  g = goal(attributes=("noise cancelling",), options=())
  same_title = dict(query="speaker", product_category="Electronics › Speakers")
  # query and category differ; title words shared: {kova, wireless, earbuds, noise,
  # cancelling, fast, charging} has 7 words, 2 shared (2/7 > 0.2): r_type 1
  assert reward.type_factor(product(title="Zu Wireless Earbuds", **same_title), g) == 1.0
  # 1 of 7 (0.14: not above 0.2, not below 0.1) and no query/category match: 0.5
  assert reward.type_factor(product(title="Zu Earbuds Case", **same_title), g) == 0.5
  # none shared: 0 (the whole reward is 0 even though the attribute matches)
  p = product(title="Desk Lamp", **same_title)
  assert reward.type_factor(p, g) == 0.0 and reward.score(p, g, {}).reward == 0.0
  # 1 of 11 words (< 0.1): 0.1
  long_goal = goal(product_name="alpha beta gamma delta epsilon zeta eta theta iota kappa earbuds",
                   options=())
  assert len(reward.title_words(long_goal.product_name)) == 11
  assert reward.type_factor(product(title="Earbuds", **same_title), long_goal) == 0.1
  # the same query alone is enough when some title word is shared
  assert reward.type_factor(product(title="Zu Earbuds Case", query="wireless earbuds"), g) == 1.0


def test_reward_caps_options_at_goal_count():
  p = product(description="black and white and small")   # every chosen value is in the text
  g = goal(options=("black",))
  assert reward.score(p, g, {"color": "white", "size": "small"}).option_matches == 1


# -- pages, actions, invalid actions --------------------------------------------------------
@pytest.fixture(scope="module")
def goals():
  return make_goals("train", 60, seed=0)


def test_parse_action_last_wins_case_insensitive():
  assert env.parse_action("think: maybe click[a] ... Click[ Buy Now ]") == env.Action("click", "Buy Now")
  assert env.parse_action("SEARCH[red shoes]") == env.Action("search", "red shoes")
  assert env.parse_action("I would buy it") is None


def test_pages_and_invalid_actions(goals):
  g = goals[0]
  backend = WebShopBackend()
  with backend.start(g) as s:
    first = s.observation()
    assert g.instruction in first and "[Search]" in first
    r = s.step(env.Action("click", "Buy Now"))              # nothing to click on the search page
    assert not r.valid and r.observation.startswith(env.INVALID) and r.observation.endswith(first)
    r = s.step(None)
    assert not r.valid and r.observation.startswith(env.PARSE_ERROR_OBSERVATION)
    assert not s.step(env.Action("search", "")).valid
    r = s.step(env.Action("search", agents.oracle_query(g)))
    assert r.valid and "Page 1 (Total results: 50)" in r.observation and "[Next >]" in r.observation
    assert "[< Prev]" not in r.observation
    assert not s.step(env.Action("search", "again")).valid   # search only on the search page
    page1 = s.page_asins()
    s.step(env.Action("click", "next >"))
    assert s.page_no == 2 and s.page_asins() != page1 and "[< Prev]" in s.observation()
    s.step(env.Action("click", "< Prev"))
    assert s.page_asins() == page1
    asin = page1[0]
    r = s.step(env.Action("click", asin.lower()))
    assert s.page == env.ITEM and "[Buy Now]" in r.observation
    p = g.catalog.by_asin[asin]
    value = p.options[0][1][0]
    r = s.step(env.Action("click", value))
    assert r.observation.startswith(f"You have clicked {value}.") and s.options == {p.options[0][0]: value}
    r = s.step(env.Action("click", "Features"))
    assert s.page == env.DETAIL and p.bullet_points[0] in r.observation and "[Buy Now]" not in r.observation
    s.step(env.Action("click", "< prev"))
    assert s.page == env.ITEM and s.options == {p.options[0][0]: value}   # options kept
    r = s.step(env.Action("click", "buy now"))
    assert r.done and s.purchase.reward == reward.score(p, g, {p.options[0][0]: value}).reward
    with pytest.raises(RuntimeError):
      s.step(env.Action("click", "buy now"))
  assert backend.leftovers() == {"sessions": 0}


def test_back_to_search_resets(goals):
  with WebShopBackend().start(goals[1]) as s:
    s.step(env.Action("search", "anything at all"))
    s.step(env.Action("click", "Back to Search"))
    assert s.page == env.SEARCH and s.results == ()
    assert s.step(env.Action("search", "zzzzqqq")).observation.count("[B0") == 0   # no hits


def test_episode_surface_and_step_limit(goals):
  backend = WebShopBackend()
  g = goals[2]
  with backend.start(g) as h:
    ep = WebShopEpisode(g, h, max_steps=4, parse_error_penalty=0.4)
    assert [m["role"] for m in ep.messages] == ["system", "user"]
    assert "4 actions" in ep.messages[0]["content"]
    assert not ep.step("no action here")
    assert not ep.step("click[nothing]")
    assert not ep.step("search[x]")
    assert ep.step("click[Back to Search]")                # 4th step: the limit
    out = ep.finish()
  assert isinstance(out, protocol.EpisodeOutcome)
  assert (out.passed, out.fraction, out.turns, out.parse_errors) == (False, 0.0, 4, 1)
  assert out.failure == protocol.PARSE_ERROR and out.reward == pytest.approx(-0.1)
  assert out.timings["invalid_actions"] == 1 and out.timings["purchased"] is False
  assert ep.finish() is out


# -- agents -----------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_oracle_solves_every_generated_goal(split):
  gs = make_goals(split, 100, seed=3)
  backend = WebShopBackend()
  for g in gs:
    out, messages = play(backend, g, agents.scripted(agents.oracle_replies(g)))
    assert out.passed and out.reward == 1.0 and out.failure is None, g.instruction
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == "click[Buy Now]"
  assert backend.leftovers() == {"sessions": 0}


def test_noop_and_random_fail(goals):
  backend = WebShopBackend()
  noop = [play(backend, g, agents.noop())[0] for g in goals]
  assert not any(o.passed for o in noop) and all(o.reward == 0 and o.failure == "NOT_PURCHASED" for o in noop)
  rand = [play(backend, g, agents.random_agent(g, seed))[0] for g in goals for seed in range(4)]
  assert sum(o.passed for o in rand) / len(rand) < 0.10
  assert 0 < sum(o.fraction for o in rand) / len(rand) < 0.5     # partial reward: a usable signal


def test_transcript_is_a_passing_oracle_episode(goals):
  messages = transcript(goals[0], WebShopBackend())
  assert [m["role"] for m in messages[:3]] == ["system", "user", "assistant"]
  assert messages[2]["content"].startswith("search[")
  custom = transcript(goals[0], WebShopBackend(),
                      lambda g, h: WebShopEpisode(g, h, max_steps=15, system_prompt="Shop."))
  assert custom[0]["content"] == "Shop." and custom[1:] == messages[1:]
  # a step limit too short for the plan: no transcript
  assert transcript(goals[0], WebShopBackend(), lambda g, h: WebShopEpisode(g, h, max_steps=2)) is None


# -- generation: determinism, disjoint splits, validation --------------------------------------
def test_goals_are_deterministic_and_splits_disjoint():
  a = make_goals("train", 40, seed=1)
  b = make_goals("train", 40, seed=1)
  assert [(g.name, g.instruction, g.asin, g.price_upper) for g in a] == \
      [(g.name, g.instruction, g.asin, g.price_upper) for g in b]
  assert [g.instruction for g in make_goals("train", 20, seed=1, start=20)] == [g.instruction for g in a[20:]]
  assert [g.instruction for g in make_goals("train", 40, seed=2)] != [g.instruction for g in a]
  held = make_goals("heldout", 200, seed=1)
  train = make_goals("train", 400, seed=1)
  assert not {g.asin for g in held} & {g.asin for g in train}
  assert all(generator.product_split(g.asin) == "heldout" for g in held)
  # the catalog itself is a pure function of its seeds (built again without the cache)
  fresh = generator.catalog.__wrapped__(200, 0)
  assert fresh.products == generator.catalog(200, 0).products
  assert fresh.products != generator.catalog.__wrapped__(200, 1).products


def test_goal_text_names_attributes_options_and_bound(goals):
  for g in goals:
    assert all(a in g.instruction for a in g.attributes) and all(o in g.instruction for o in g.options)
    assert f"price lower than {g.price_upper:.2f} dollars" in g.instruction
    target = g.catalog.by_asin[g.asin]
    assert target.price < g.price_upper and g.price_upper % 10 == 0


def test_results_per_page():
  # WebShop's 10 by default; a smaller page shows fewer hits, pages through the same ranking,
  # and the oracle (hence goal solvability within max_steps) sees the same pages.
  g10 = make_goals("train", 12, seed=0)
  g3 = make_goals("train", 12, seed=0, results_per_page=3)
  assert all(g.results_per_page == 10 for g in g10) and all(g.results_per_page == 3 for g in g3)
  g = g3[0]
  with WebShopBackend().start(g) as s:
    r = s.step(env.Action("search", agents.oracle_query(g)))
    assert len(s.page_asins()) == 3 and sum(f"[{a}]" in r.observation for a in s.results) == 3
    first = s.results
    s.step(env.Action("click", "Next >"))
    assert s.page_asins() == first[3:6]
  for goal in g3:
    plan = agents.oracle_actions(goal, 15)
    assert plan is not None and plan[-1] == "click[Buy Now]"
    assert play(WebShopBackend(), goal, agents.scripted(plan))[0].passed
  # a plan that walks pages needs more Next > clicks on small pages
  nexts = lambda goals: sum(a == "click[Next >]" for goal in goals for a in agents.oracle_actions(goal, 15))
  assert nexts(g3) >= nexts(g10)
  with pytest.raises(ValueError, match="results_per_page"):
    make_goals("train", 1, results_per_page=0)


def test_short_asins():
  # WebShop's 10-character ids by default; a shorter id is unique across the catalog (short ids
  # collide and are redrawn), deterministic, and leaves every other field of every product as is
  default = generator.catalog(200, 0)
  assert all(len(p.asin) == 10 and p.asin.startswith("B0") for p in default.products)
  short = generator.catalog.__wrapped__(200, 0, 4)
  assert [len(p.asin) for p in short.products] == [4] * 200 and len(short.by_asin) == 200
  assert short.products == generator.catalog.__wrapped__(200, 0, 4).products
  strip = lambda p: dataclasses.replace(p, asin="")
  assert list(map(strip, short.products)) == list(map(strip, default.products))
  goals = make_goals("heldout", 6, seed=0, asin_length=5, max_steps=8, results_per_page=3)
  assert all(len(g.asin) == 5 and generator.product_split(g.asin) == "heldout" for g in goals)
  for goal in goals:
    plan = agents.oracle_actions(goal, 8)
    assert any(a[6:-1] in goal.catalog.by_asin and len(a) == 12 for a in plan)   # click[B0XYZ]
    assert play(WebShopBackend(), goal, agents.scripted(plan))[0].passed
  with pytest.raises(ValueError, match="asin_length 4 gives 1156 ids"):
    generator.catalog(1000, 0, 4)
  with pytest.raises(ValueError, match=r"asin_length must be in \[3, 10\]"):
    generator.catalog(200, 0, 11)


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="split"):
    make_goals("test", 1)
  with pytest.raises(ValueError, match="num_products"):
    make_goals("train", 1, num_products=5)
  with pytest.raises(TypeError, match="webshop Goal"):
    WebShopBackend().start(object())


# -- threads -----------------------------------------------------------------------------------
def test_parallel_episodes_match_sequential(goals):
  backend = WebShopBackend()
  jobs = [(g, seed) for g in goals[:30] for seed in range(3)]

  def one(job):
    g, seed = job
    out, messages = play(backend, g, agents.random_agent(g, seed))
    return out.fraction, out.turns, [m["content"] for m in messages]

  sequential = [one(j) for j in jobs]
  with cf.ThreadPoolExecutor(8) as pool:
    parallel = list(pool.map(one, jobs))
  assert parallel == sequential
  assert backend.leftovers() == {"sessions": 0}


# -- the checker --------------------------------------------------------------------------------
def test_checker(tmp_path, capsys):
  assert envs_check.main(["--env", "webshop", "--generated", "30", "--agent", "oracle", "--workers", "2"]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert (summary["passed"], summary["mean_reward"], summary["leaked"]) == (30, 1.0, 0)
  assert envs_check.main(["--env", "webshop", "--generated", "10", "--agent", "noop"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["passed"] == 0
  g = make_goals("train", 1, seed=0)[0]
  replay = tmp_path / "replay.json"
  replay.write_text(json.dumps({g.name: agents.oracle_replies(g)}))
  assert envs_check.main(["--env", "webshop", "--generated", "2", "--agent", f"replay:{replay}"]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["passed"] == 1 and summary["failures"] == {"NOT_PURCHASED": 1}
  with pytest.raises(SystemExit, match="expected oracle"):
    envs_check.main(["--env", "webshop", "--generated", "2", "--agent", "bogus"])
  # The WebShop checker that `--env webshop` runs, called as a library.
  goals = make_goals("train", 3, seed=1)
  for agent, passed in (("oracle", 3), ("noop", 0)):
    results, leaked = webshop_check.run_checks(goals, agent)
    assert webshop_check.summarize(results, leaked)["passed"] == passed and leaked == 0

"""WebShop by config: the paper's WebShop grid (configs/paper_webshop.py), the CPU demo
(configs/demo_webshop.py), and the off-protocol warm start (webshop.off_protocol)."""
import json

import pytest

from jaxes.envs import webshop
from jaxes.envs.webshop.offprotocol import off_protocol
from jaxes.envs.webshop.env import parse_action
from jaxes.train import builders
from jaxes.train.config import ConfigError, load_config_file, validate
import helpers_repo

ROOT = helpers_repo.REPO


def _load(name, *args):
  return load_config_file(ROOT / "configs" / f"{name}.py", *args)


@pytest.mark.parametrize("arg,delay,fraction,stale", [
    ("sync", 0, 0.0, 0), ("async1", 0, 0.0, 0), ("delay4", 4, 0.1, 0), ("delay8", 8, 0.1, 0),
    ("allstale", 0, 0.0, 4), ("lag2-frac25,v5p-64", 2, 0.25, 0), ("lag8-frac50,8xH200", 8, 0.5, 0)])
def test_paper_webshop_variants(arg, delay, fraction, stale, tmp_path):
  c = _load("paper_webshop", arg)
  (tmp_path / "config.json").write_text("{}")
  c.model.path = str(tmp_path)
  validate(c)
  paper = _load("paper", arg.replace(arg.split(",")[0], "async1"))
  assert c.env.kind == "webshop" and c.webshop.max_steps == 15 and c.eval.num_tasks == 500
  assert (c.model.preset, c.es.population, c.es.sigma, c.rollout.max_len) == (
      paper.model.preset, paper.es.population, paper.es.sigma, paper.rollout.max_len)
  assert (c.mesh.data, c.mesh.tensor, c.mesh.target) == (paper.mesh.data, paper.mesh.tensor, paper.mesh.target)
  assert (c.controller.mode == "sync") == arg.startswith("sync")
  assert (c.controller.delay_updates, c.controller.delay_fraction, c.controller.stress_all_stale) == (
      delay, fraction, stale)


def test_paper_webshop_rejects_unknown_variant_and_target():
  with pytest.raises(ValueError, match="unknown variant 'lag3-frac10'"):
    _load("paper_webshop", "lag3-frac10")
  with pytest.raises(ValueError, match="unknown target"):
    _load("paper_webshop", "async1,v4-8")


def test_demo_webshop_is_valid():
  c = _load("demo_webshop")
  validate(c)
  assert c.env.kind == "webshop" and c.warmstart.off_protocol_fraction == 0.0 < c.webshop.off_protocol_fraction


def test_results_per_page_by_config():
  c = _load("demo_webshop")
  c.webshop.num_products = 200
  c.env.num_heldout_tasks = 2
  assert [g.results_per_page for g in builders.heldout_tasks(c)] == [c.webshop.results_per_page] * 2
  assert _load("paper_webshop", "sync").webshop.results_per_page == 10   # WebShop's page
  c.webshop.results_per_page = 0
  with pytest.raises(ConfigError, match=r"webshop\.results_per_page"):
    validate(c)


def test_off_protocol_replies_do_not_parse_and_are_seeded():
  assert webshop.offprotocol.tool_call("search[red shoes]") == '{"action": "search", "query": "red shoes"}'
  goals = webshop.make_goals("train", 20, seed=0, num_products=200)
  backend = webshop.WebShopBackend()
  transcripts = [t for t in (webshop.transcript(g, backend) for g in goals) if t]
  out = off_protocol(transcripts, 0.5, seed=3)
  assert out == off_protocol(transcripts, 0.5, seed=3)
  rewritten = [o for o, t in zip(out, transcripts) if o != t]
  assert 0 < len(rewritten) < len(transcripts)
  for o, t in zip(out, transcripts):
    assert [m for m in o if m["role"] != "assistant"] == [m for m in t if m["role"] != "assistant"]
    for a, b in zip(o, t):
      if a["role"] == "assistant" and o in rewritten:
        assert parse_action(a["content"]) is None
        call = json.loads(a["content"])
        assert parse_action(b["content"]).arg == call.get("query", call.get("element"))
  assert off_protocol(transcripts, 0.0, 0) == transcripts
  with pytest.raises(ValueError, match="fraction"):
    off_protocol(transcripts, 1.5, 0)


def test_off_protocol_by_config():
  c = _load("demo_webshop")
  c.warmstart.num_tasks = 8
  c.webshop.num_products = 200
  c.webshop.off_protocol_fraction = 1.0
  transcripts = builders.oracle_transcripts(c, webshop.WebShopBackend())
  assert len(transcripts) == 8
  assert all(parse_action(m["content"]) is None for t in transcripts for m in t if m["role"] == "assistant")
  c.warmstart.off_protocol_fraction = 0.5
  with pytest.raises(ConfigError, match=r"config\.warmstart\.off_protocol_fraction: .*webshop\.off_protocol_fraction"):
    validate(c)

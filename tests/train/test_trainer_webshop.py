"""ES on WebShop by config (env.kind = "webshop"): the same trainer, engine, controller and
evaluation; a tokenizer built from WebShop's texts and oracle transcripts; sessions all closed."""
import json

from helpers_train import tiny_config
from jaxes.envs import webshop
from jaxes.train import metrics
from jaxes.train.trainer import Trainer


def test_few_es_updates_on_webshop(tmp_path):
  c = tiny_config("", **{"env.kind": "webshop", "env.system_prompt": "", "tokenizer.vocab_size": 400,
                         "webshop.max_steps": 5, "webshop.num_products": 200,
                         "controller.mode": "async", "controller.max_staleness": 1,
                         "rollout.max_len": 1024, "rollout.prefill_chunk": 128,
                         "rollout.max_new_tokens": 12, "rollout.temperature": 1.0,
                         "rollout.sandbox_steps": 1, "warmstart.num_tasks": 4,
                         "env.num_train_tasks": 4, "eval.num_tasks": 2, "train.plot": False})
  backend = webshop.WebShopBackend()
  summary = Trainer(c, str(tmp_path / "run"), sandbox=backend, log=lambda s: None).run()
  assert summary["version"] == 2
  records = metrics.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  train = [r for r in records if "train" in r]
  assert [r["version"] for r in train] == [1, 2]
  for r in train:
    assert r["num_results"] >= 1 and 0.0 <= r["fitness"]["min"] <= r["fitness"]["max"] <= 1.0
  assert [r["version"] for r in records if "eval" in r] == [0, 2]
  assert json.load(open(tmp_path / "run" / "summary.json"))["after"]["episodes"] == 2
  assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
  assert backend.leftovers() == {"sessions": 0}

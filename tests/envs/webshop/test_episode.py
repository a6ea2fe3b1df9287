"""WebShop episodes through the real EpisodeRunner and engine (tiny random model): the backend
and episode plug in where the sandbox and protocol.Episode go, and every session is closed."""
import shutil
import tempfile

import pytest
from flax import nnx

from jaxes import tokenization
from jaxes.envs import webshop
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeRunner, EpisodeSpec


@pytest.fixture(scope="module")
def setup():
  goals = webshop.make_goals("train", 4, seed=0)
  texts = 16 * webshop.tokenizer_texts(2) + [g.instruction for g in goals]
  texts += [m["content"] for m in webshop.transcript(goals[0], webshop.WebShopBackend())]
  tok_dir = tempfile.mkdtemp(prefix="jaxes-test-webshop-tok-")
  tok = tokenization.build_tokenizer(texts, 400, tok_dir)
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                 num_layers=1, num_heads=2, num_kv_heads=1)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  yield goals, tok, cfg, graphdef, params
  shutil.rmtree(tok_dir, ignore_errors=True)


def test_runner_plays_webshop_episodes(setup):
  goals, tok, cfg, graphdef, params = setup
  backend = webshop.WebShopBackend()
  engine = Engine(graphdef, cfg, num_slots=2, max_len=1024, prefill_chunk=128, max_new_tokens=6,
                  stop_ids=[], im_end_id=tok.convert_tokens_to_ids("<|im_end|>"))
  episodes = {}

  def make_episode(goal, handle):
    episodes[goal.name] = webshop.WebShopEpisode(goal, handle, max_steps=2)
    return episodes[goal.name]

  runner = EpisodeRunner(engine, tok, backend, make_episode=make_episode, workers=2, sandbox_steps=1)
  todo = [EpisodeSpec(i, g, 0, -1, stream=i, temperature=1.0) for i, g in enumerate(goals)][::-1]
  results = []
  try:
    while len(results) < len(goals):
      for _ in runner.free_slots()[:len(todo)]:
        runner.submit(todo.pop())
      results += runner.poll({0: params}, block=True)
  finally:
    runner.close()
    backend.shutdown()
  assert sorted(r.spec.key for r in results) == list(range(len(goals)))
  for r in results:
    episode = episodes[r.spec.task.name]
    assert r.reward is not None and r.reward == episode.finish().reward and 0.0 <= r.reward <= 1.0
    assert r.turns == episode.turns and (1 <= r.turns <= 2 or r.truncated)
    roles = [m["role"] for m in episode.messages]
    assert roles[:2] == ["system", "user"] and roles[2] == "assistant"
  assert backend.leftovers() == {"sessions": 0}

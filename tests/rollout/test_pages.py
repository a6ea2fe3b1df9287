"""A paged KV cache in the rollout engine (``Engine(page_size=, num_pages=)``): it decodes the
dense cache's tokens and log-probs (full batch, compacted rows, several versions in one call, an
8-device mesh), its pages are accounted exactly (every page returns, none is handed out twice),
a new episode waits for its prompt's pages, an episode that finds no page ends truncated with
its reason, and it compiles as many programs as the dense cache."""
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers_models import assert_same_turns, es_bank, ragged_turns, tiny_model
from jaxes import es, sharding, tokenization
from jaxes.envs import protocol
from jaxes.envs.sandboxes.local_sandbox import LocalSandbox
from jaxes.envs.tasks import generator
from jaxes.models import qwen2
from jaxes.rollout import pages
from jaxes.rollout.engine import PAGES_EXHAUSTED, PARKED, Engine
from jaxes.rollout.episodes import EpisodeRunner, EpisodeSpec
from jaxes.rollout.policy_bank import VersionSteps

IM_END = 3
SLOTS = 8
POP = 8


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64)


def _engine(model, strategy=None, run_key=None, version_steps=None, **kw):
  cfg, graphdef, _ = model
  policy = es_bank(strategy, run_key, version_steps=version_steps)
  args = dict(num_slots=SLOTS, max_len=64, prefill_chunk=8, max_new_tokens=5, stop_ids=[],
              im_end_id=IM_END, policy=policy)
  return Engine(graphdef, cfg, **{**args, **kw})


def _strategy_states(params, updates=1):
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  states, cohorts = [strategy.init(params, jax.random.key(1))], []
  for u in range(updates):
    results = [(u, m, float((m * (u + 3)) % 5)) for m in range(POP)]
    cohorts.append(strategy.cohort(states[-1], results))
    states.append(strategy.update(states[-1], results)[0])
  return strategy, states, cohorts


_DENSE = {}
VERSIONS = [0, 1, 0, 1, 0, 1, 1]


def _dense_turns(model, compact):
  """The dense one-device engine's turns (shared by the tests that compare with them)."""
  if compact not in _DENSE:
    _, _, params = model
    strategy, states, _ = _strategy_states(params)
    dense = _engine(model, strategy, states[0].run_key, compact=compact)
    params_by_version = {v: s.params for v, s in enumerate(states)}
    _DENSE[compact] = (ragged_turns(dense, params_by_version, VERSIONS, observation_growth=2),
                       dense.stats)
  return _DENSE[compact]


@pytest.mark.parametrize("compact", [True, False])
def test_paged_cache_decodes_the_dense_caches_tokens_and_logprobs(model, compact):
  _, _, params = model
  strategy, states, _ = _strategy_states(params)
  params_by_version = {v: s.params for v, s in enumerate(states)}
  run_key = states[0].run_key
  # Pages of 4 tokens, fewer pages than the dense rows hold (8 x 64 / 4 = 128), in shuffled
  # order after the first releases: page ids are not the slots' order.
  paged = _engine(model, strategy, run_key, compact=compact, page_size=4, num_pages=96)
  want, dense_stats = _dense_turns(model, compact)
  got = ragged_turns(paged, params_by_version, VERSIONS, observation_growth=2)
  assert_same_turns(got, want, atol=1e-5)
  assert paged.stats.positions_computed == dense_stats.positions_computed
  if compact:
    assert paged.stats.rows_computed < paged.stats.rows_total   # some calls ran compacted
  used = paged.kv_bytes()
  assert used["reserved"] == 96 * 4 * used["dense_reserved"] // (SLOTS * 64)
  held = sum(pages.pages_for(s.length, 4) for s in paged.scheduler.slots)
  assert paged.scheduler.pool.in_use() == held > 0
  for slot in range(SLOTS):
    paged.scheduler.release(slot)
  assert paged.scheduler.pool.in_use() == 0 and paged.scheduler.pool.free(0) == 96


def test_paged_cache_with_all_versions_in_one_call_decodes_the_dense_tokens(model):
  _, _, params = model
  strategy, states, cohorts = _strategy_states(params, updates=2)
  params_by_version = {v: s.params for v, s in enumerate(states)}
  run_key = states[0].run_key
  steps = VersionSteps(strategy.version_step(params, run_key), POP, 2)
  versions = [0, 1, 2, 0, 1, 2, 2]
  engines = [_engine(model, strategy, run_key, version_steps=steps, **kw)
             for kw in ({}, dict(page_size=8, num_pages=64))]
  for engine in engines:
    for v, cohort in enumerate(cohorts, start=1):
      assert engine.policy.add_step(v, *cohort)
  want, got = (ragged_turns(e, params_by_version, versions, observation_growth=2) for e in engines)
  assert_same_turns(got, want, atol=1e-5)
  assert engines[1].stats.multi_version_calls == engines[0].stats.multi_version_calls > 0


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_paged_cache_on_a_data4_tensor2_mesh_decodes_the_one_device_dense_tokens(model):
  """Pages over the data shards with their slots (page ids shard-local), KV heads over tensor."""
  _, _, params = model
  strategy, states, _ = _strategy_states(params)
  params_by_version = {v: s.params for v, s in enumerate(states)}
  want, _ = _dense_turns(model, False)
  mesh = sharding.make_mesh(data=4, tensor=2)
  paged = _engine(model, strategy, states[0].run_key, mesh=mesh, page_size=4, num_pages=128)
  spec = paged.cache.k.sharding.spec
  assert spec == jax.sharding.PartitionSpec(None, "data", None, "tensor", None)
  assert {s.data.shape[1] for s in paged.cache.k.addressable_shards} == {128 // 4}
  got = ragged_turns(paged, params_by_version, VERSIONS, observation_growth=2)
  # The same tokens; the log-probs within the default 1e-4, not 1e-5 as on one device: the
  # tensor-sharded projections sum in another order (a CI run measured 1.2e-5 at a log-prob of -4.57).
  assert_same_turns(got, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 12)),
                min_size=1, max_size=80))
def test_page_pool_never_over_commits_and_every_page_returns(ops):
  pool = pages.PagePool(shards=4, pages_per_shard=10)
  held = {d: [] for d in range(4)}
  for op, shard, n in ops:
    free = pool.free(shard)
    if op < 2:
      got = pool.take(shard, n)
      if n > free:
        assert got is None and pool.free(shard) == free
      else:
        assert len(got) == n and not set(got) & {p for group in held[shard] for p in group}
        held[shard].append(got)
    elif held[shard]:
      pool.give(shard, held[shard].pop(0))
    for d in range(4):
      out = [p for group in held[d] for p in group]
      assert pool.in_use(d) == len(out) == len(set(out))
      assert pool.free(d) + pool.in_use(d) == 10
      assert all(0 <= p < 10 for p in out)
  for d in range(4):
    for group in held[d]:
      pool.give(d, group)
    assert pool.free(d) == 10
  with pytest.raises(ValueError, match="not taken"):
    pool.give(0, [0])


def test_random_engine_sequences_return_every_page(model):
  """Random start / step / continue / release on a small paged engine: a slot holds exactly the
  pages its tokens need (one more while a decoding row waits to feed its next token), nothing
  is over-committed, and releasing everything returns every page."""
  _, _, params = model
  engine = _engine(model, max_new_tokens=6, page_size=4, num_pages=24, mesh=None)
  rng = np.random.default_rng(11)
  for _ in range(70):
    op = rng.integers(4)
    free = engine.scheduler.free_slots()
    if op == 0 and free:
      slot, prompt = int(rng.choice(free)), list(rng.integers(4, 64, size=int(rng.integers(1, 40))))
      if engine.scheduler.can_start(slot, len(prompt)):
        engine.scheduler.start(slot, prompt, version=0, member=-1, stream=slot)
    elif op == 1:
      parked = [s.index for s in engine.scheduler.slots if s.state == PARKED]
      if parked:
        slot = int(rng.choice(parked))
        if not engine.scheduler.continue_turn(slot, list(rng.integers(4, 64, size=int(rng.integers(1, 20))))):
          engine.scheduler.release(slot)
    elif op == 2:
      busy = [s.index for s in engine.scheduler.slots if s.state != "free"]
      if busy:
        engine.scheduler.release(int(rng.choice(busy)))
    elif engine.scheduler.busy():
      for turn in engine.step({0: params}):
        if turn.failure is not None:
          assert turn.failure == PAGES_EXHAUSTED
          engine.scheduler.release(turn.slot)
    for s in engine.scheduler.slots:
      tokens = s.length + len(s.pending)
      assert len(s.pages) in (pages.pages_for(tokens, 4), pages.pages_for(tokens, 4) + 1)
    assert engine.scheduler.pool.in_use() == sum(len(s.pages) for s in engine.scheduler.slots) <= 24
    assert len({p for s in engine.scheduler.slots for p in s.pages}) == engine.scheduler.pool.in_use()
  for slot in range(SLOTS):
    engine.scheduler.release(slot)
  assert engine.scheduler.pool.in_use() == 0 and engine.scheduler.pool.free(0) == 24


def test_admission_waits_for_pages_and_an_outgrowing_episode_ends_truncated(model):
  _, _, params = model
  engine = _engine(model, max_new_tokens=20, page_size=4, num_pages=6)
  assert engine.scheduler.start(0, list(range(4, 20)), version=0, member=-1, stream=0)   # 4 pages
  assert engine.scheduler.pool.free(0) == 2
  assert not engine.scheduler.can_start(1, 9)                      # 3 pages, 2 free: wait
  with pytest.raises(ValueError, match="can_start"):
    engine.scheduler.start(1, list(range(4, 13)), version=0, member=-1, stream=1)
  assert engine.scheduler.can_start(1, 8)
  assert engine.scheduler.can_start(1, 40)   # more than all 6 pages: it can never fit, start refuses it
  assert not engine.scheduler.start(1, list(range(4, 44)), version=0, member=-1, stream=1)
  assert engine.scheduler.start(1, list(range(4, 12)), version=0, member=-1, stream=1)   # 2 pages
  assert engine.scheduler.free_slots() == []                       # no page left: no slot admissible
  turns = []
  while engine.scheduler.busy():
    turns += engine.step({0: params})
  # Both rows filled their last page and found no other: each turn was cut short.
  assert sorted(t.slot for t in turns) == [0, 1]
  for t in turns:
    assert t.failure == PAGES_EXHAUSTED and not t.stopped and len(t.tokens) >= 1
    assert engine.scheduler.slots[t.slot].length == 4 * len(engine.scheduler.slots[t.slot].pages)
    assert not engine.scheduler.continue_turn(t.slot, [5])
  engine.scheduler.release(0)
  assert engine.scheduler.can_start(2, 9) and engine.scheduler.free_slots() == [0] + list(range(2, SLOTS))


def test_paged_engine_compiles_the_dense_engines_programs(model):
  """The same programs as the dense engine (names: the same token buckets x spans), and run
  twice over, no compilation past that bound and none the second time."""
  _, _, params = model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  run_key = jax.random.key(0)
  dense = _engine(model, strategy, run_key, abstract=True)
  paged = _engine(model, strategy, run_key, abstract=True, page_size=8, num_pages=32)
  assert sorted(paged.programs()) == sorted(dense.programs())
  engine = _engine(model, page_size=8, num_pages=64)
  for round_ in range(2):
    ragged_turns(engine, {0: params}, [0] * 7, observation_growth=2)
    for slot in range(SLOTS):
      engine.scheduler.release(slot)
    if round_ == 0:
      warm = engine.compilations()
  assert engine.compilations() == warm      # the same shapes again: nothing new compiles
  # step programs and the reset
  assert warm <= len(engine.buckets) * len(engine.spans) + 1


def test_bad_page_arguments_are_clear_errors(model):
  with pytest.raises(ValueError, match="go together"):
    _engine(model, page_size=4)
  with pytest.raises(ValueError, match="must divide every attention span"):
    _engine(model, page_size=12, num_pages=12)
  with pytest.raises(ValueError, match="not divisible by the mesh's data"):
    _engine(model, page_size=4, num_pages=30, mesh=sharding.make_mesh(data=4, tensor=2))


@pytest.fixture(scope="module")
def runner_setup():
  tasks = [generator.generate("log_count", s, 1) for s in range(3)]
  tok_dir = tempfile.mkdtemp(prefix="paged-test-tok-")
  system = "Answer with <command>CMD</command>, then <action>done</action>."
  tok = tokenization.build_tokenizer(16 * [system] + [t.instruction for t in tasks], 400, tok_dir)
  cfg, graphdef, params = tiny_model("tiny", vocab_size=len(tok), hidden_size=32,
                                     intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
  root = tempfile.mkdtemp(prefix="paged-test-episodes-")
  os.chmod(root, 0o711)  # the sandbox uid must traverse it
  yield tasks, tok, system, cfg, graphdef, params, os.path.join(root, "sandboxes")
  shutil.rmtree(root, ignore_errors=True)
  shutil.rmtree(tok_dir, ignore_errors=True)


def _run_episodes(runner_setup, num_pages, max_new_tokens):
  tasks, tok, system, cfg, graphdef, params, root = runner_setup
  sandbox = LocalSandbox(root_dir=root)
  engine = Engine(graphdef, cfg, num_slots=2, max_len=256, prefill_chunk=32,
                  max_new_tokens=max_new_tokens, stop_ids=[],
                  im_end_id=tok.convert_tokens_to_ids("<|im_end|>"), page_size=16,
                  num_pages=num_pages)
  runner = EpisodeRunner(engine, tok, sandbox, workers=2, sandbox_steps=2,
                         make_episode=lambda task, h: protocol.Episode(task, h, system_prompt=system))
  todo = [EpisodeSpec(i, task, 0, -1, stream=i, temperature=1.0) for i, task in enumerate(tasks)]
  results, most = [], 0
  try:
    while len(results) < len(tasks):
      for _ in runner.free_slots()[:len(todo)]:
        runner.submit(todo.pop(0))
      results += runner.poll({0: params}, block=True)
      most = max(most, sum(s.state != "free" for s in engine.scheduler.slots))
      assert engine.scheduler.pool.in_use() <= num_pages
  finally:
    runner.close()
    sandbox.shutdown()
  assert engine.scheduler.pool.in_use() == 0
  return results, most


def test_runner_waits_for_pages_and_ends_an_outgrowing_episode_as_truncated(runner_setup):
  """8 pages of 16 tokens for 2 slots, prompts of 70 tokens (5 pages): the second episode waits
  (its sandbox up, its slot reserved) until the first one's pages return; each one outgrows
  the pages and ends truncated with the reason, its verifier run."""
  tasks = runner_setup[0]
  results, most = _run_episodes(runner_setup, num_pages=8, max_new_tokens=200)
  assert len(results) == len(tasks) and most == 1
  for r in results:
    assert r.truncated and r.failure == PAGES_EXHAUSTED and r.reward is not None
    assert r.tokens is not None and r.tokens.turns


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
def test_compiled_paged_steps_update_the_pages_in_place(model):
  """On data=4 x tensor=2 the donated pages are aliased to the step's output and the
  temporaries stay below one copy of the keys' pages (the decode buckets: at most a token
  per row; the prefill bucket's portable path gathers key blocks per token, see
  docs/engine.md)."""
  mesh = sharding.make_mesh(data=4, tensor=2)
  engine = _engine(model, mesh=mesh, max_len=4096, abstract=True, page_size=64,
                   num_pages=SLOTS * 4096 // 64 // 2)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.cache)) // 8
  key_bytes = engine.cache.k.size * engine.cache.k.dtype.itemsize // 8
  programs = engine.programs()
  for t in engine.buckets[:-1]:
    name = f"step[t={t * 4},span=4096]"
    stats = programs[name].compile().memory_analysis()
    assert stats.alias_size_in_bytes >= cache_bytes, name
    assert stats.temp_size_in_bytes < key_bytes, (name, stats.temp_size_in_bytes, key_bytes)


def test_the_cache_is_split_off_tpu_and_an_interleaved_one_counts_the_same_bytes(model):
  cfg, _, _ = model
  paged = _engine(model, page_size=4, num_pages=32, abstract=True)
  assert paged.cache.v.shape[3] == cfg.num_kv_heads   # CPU: keys and values apart, as before
  assert paged.cache.k.dtype == np.uint32
  split, mixed = (jax.eval_shape(lambda i=i: qwen2.PagedKVCache.init(cfg, SLOTS, 64, 4, 32,
                                                                     interleaved=i))
                  for i in (False, True))
  assert mixed.v.shape[3] == 0 and mixed.k.shape[3] == 2 * cfg.num_kv_heads
  per_token = qwen2.cache_bytes_per_token(split)
  assert qwen2.cache_bytes_per_token(mixed) == per_token == (
      2 * 4 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size)
  assert paged.kv_bytes()["reserved"] == 32 * 4 * per_token


@pytest.mark.libtpu
def test_an_engine_for_a_v5p_mesh_keeps_its_pages_interleaved_with_the_same_kv_bytes(
    model, monkeypatch):
  """The layout ``ragged_paged_attention`` reads, so the TPU programs carry the kernel."""
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock
  from jax.experimental import topologies
  cfg, _, _ = model
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  tpu = _engine(model, mesh=sharding.make_mesh(data=2, tensor=2, devices=devices), page_size=4,
                num_pages=32, abstract=True)
  cpu = _engine(model, page_size=4, num_pages=32, abstract=True)
  assert tpu.cache.k.shape[3] == 2 * cfg.num_kv_heads and tpu.cache.v.shape[3] == 0
  assert tpu.cache.k.dtype == np.dtype(cfg.dtype)
  assert tpu.kv_bytes() == cpu.kv_bytes()

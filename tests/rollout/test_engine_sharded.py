"""The rollout engine on an 8-device CPU mesh: the same tokens as the one-device full-batch
engine (low-rank and full-rank noise, rows compacted), the cache created in the rule table's
shardings and updated in place (full-batch and compacted steps), and a bounded number of
compiled programs."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers_models import es_bank
from jaxes import es, sharding
from jaxes.models import attention, qwen2
from jaxes.models.attention import softmax
from jaxes.rollout.engine import Engine
from jaxes.rollout.policy_bank import VersionSteps

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

IM_END = 3
SLOTS = 8
MESHES = {"data4xtensor2": dict(data=4, tensor=2), "data8": dict(data=8)}


@pytest.fixture(scope="module")
def model():
  cfg = qwen2.Qwen2Config.preset("tiny-gqa", vocab_size=64)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def _engine(model, mesh, strategy=None, run_key=None, version_steps=None, **kw):
  cfg, graphdef, _ = model
  policy = es_bank(strategy, run_key, version_steps=version_steps)
  args = dict(num_slots=SLOTS, max_len=64, prefill_chunk=8, max_new_tokens=6, stop_ids=[],
              im_end_id=IM_END, policy=policy, mesh=mesh)
  return Engine(graphdef, cfg, **{**args, **kw})


def _decode(engine, params_by_version, jobs):
  """Two turns per slot with ragged prompts and observations (each slot's its own, whatever
  order the turns end in); every turn's tokens by slot."""
  rng = np.random.default_rng(0)
  for slot, (version, member) in jobs.items():
    prompt = list(rng.integers(4, 64, size=int(rng.integers(2, 20))))
    assert engine.scheduler.start(slot, prompt, version=version, member=member, stream=slot)
  out = {slot: [] for slot in jobs}
  second = set()
  while engine.scheduler.busy():
    for turn in engine.step(params_by_version):
      out[turn.slot].append(turn.tokens)
      if turn.slot not in second:
        second.add(turn.slot)
        observation = np.random.default_rng(100 + turn.slot).integers(4, 64, size=1 + turn.slot)
        assert engine.scheduler.continue_turn(turn.slot, list(observation))   # whatever order turns end in
  return out


_SINGLE = {}


@pytest.mark.parametrize("mode,mesh_name", [("lowrank", "data4xtensor2"), ("lowrank", "data8"),
                                            ("full", "data4xtensor2")])
def test_sharded_engine_decodes_the_single_device_tokens(model, mode, mesh_name):
  _, _, params = model
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode=mode, rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  state1, _ = strategy.update(state0, [(0, m, float(m)) for m in range(8)])
  params_by_version = {0: state0.params, 1: state1.params}
  jobs = {s: (s % 2, s - 2) for s in range(SLOTS)}  # slots 0, 1 unperturbed; two versions
  if mode not in _SINGLE:  # the one-device full-batch reference, shared by the meshes
    _SINGLE[mode] = _decode(_engine(model, None, strategy, state0.run_key, compact=False),
                            params_by_version, jobs)
  single = _SINGLE[mode]
  mesh = sharding.make_mesh(**MESHES[mesh_name])
  engine = _engine(model, mesh, strategy, state0.run_key)
  sharded = _decode(engine, params_by_version, jobs)
  assert sharded == single
  assert len({tuple(t[0]) for t in single.values()}) > 2  # the members decode different text


def test_sharded_engine_runs_both_versions_in_one_call_with_the_single_device_tokens(model):
  """Version 1 as version 0 plus its low-rank step (``VersionSteps``) on data=4 x tensor=2:
  the tokens of the one-device engine that runs a call per version; the programs with steps
  update the cache in place too."""
  _, _, params = model
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  state0 = strategy.init(params, jax.random.key(1))
  results = [(0, m, float(m)) for m in range(8)]
  state1, _ = strategy.update(state0, results)
  params_by_version = {0: state0.params, 1: state1.params}
  jobs = {s: (s % 2, s - 2) for s in range(SLOTS)}
  single = _decode(_engine(model, None, strategy, state0.run_key, compact=False),
                   params_by_version, jobs)
  mesh = sharding.make_mesh(data=4, tensor=2)
  steps = VersionSteps(strategy.version_step(params, state0.run_key), 8, 1)
  engine = _engine(model, mesh, strategy, state0.run_key, version_steps=steps)
  assert engine.policy.add_step(1, *strategy.cohort(state0, results))
  assert _decode(engine, params_by_version, jobs) == single
  assert engine.stats.multi_version_calls > 0

  abstract = _engine(model, mesh, strategy, state0.run_key, max_len=4096, abstract=True,
                     version_steps=steps)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.cache)) // 8
  programs = abstract.programs()
  # The decode buckets (the prefill bucket's portable path gathers key blocks per token).
  for name in ("step[t=8,span=4096,steps=1]", "step[t=4,span=4096,steps=1]"):
    stats = programs[name].compile().memory_analysis()
    assert stats.alias_size_in_bytes >= cache_bytes, name
    assert stats.temp_size_in_bytes < cache_bytes / 4, (name, stats.temp_size_in_bytes, cache_bytes)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_cache_is_created_in_the_rule_tables_shardings(model, mesh_name):
  cfg, _, _ = model
  mesh = sharding.make_mesh(**MESHES[mesh_name])
  engine = _engine(model, mesh)
  for name, axes in qwen2.KVCache.LOGICAL_AXES.items():
    array = getattr(engine.cache, name)
    assert array.sharding.spec == sharding.logical_to_spec(axes), name
  data, tensor = mesh.shape["data"], mesh.shape["tensor"]
  local = (cfg.num_layers, SLOTS // data, 64, cfg.num_kv_heads // tensor, cfg.head_size)
  assert {s.data.shape for s in engine.cache.k.addressable_shards} == {local}
  assert engine.cache.k.sharding.spec == P(None, "data", None, "tensor", None)


def test_compiled_step_updates_the_cache_in_place(model):
  """The donated cache is aliased to the step's output and no temporary holds a second copy."""
  cfg, _, _ = model
  mesh = sharding.make_mesh(data=4, tensor=2)
  max_len = 4096
  engine = _engine(model, mesh, max_len=max_len, abstract=True)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.cache)) // 8
  programs = engine.programs()
  # The decode buckets (per data shard: 1 of its 2 rows, both), each writing its new tokens
  # into the cache and reading its key blocks in place; the prefill bucket (both + a chunk of
  # 8) writes in place too, but its portable path gathers key blocks per token (its
  # temporaries: docs/engine.md).
  assert engine.buckets == [1, 2, 10]
  for name in ("step[t=4,span=4096]", "step[t=8,span=4096]", "step[t=40,span=4096]"):
    assert programs[name].compile().memory_analysis().alias_size_in_bytes >= cache_bytes, name
  for name in ("step[t=4,span=4096]", "step[t=8,span=4096]"):
    stats = programs[name].compile().memory_analysis()
    assert stats.alias_size_in_bytes >= cache_bytes, name
    assert stats.temp_size_in_bytes < cache_bytes / 4, (name, stats.temp_size_in_bytes, cache_bytes)


def test_abstract_engine_allocates_nothing_and_lowers_every_program(model):
  mesh = sharding.make_mesh(data=4, tensor=2)
  strategy = es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="lowrank")
  engine = _engine(model, mesh, strategy, jax.random.key(0), abstract=True)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(engine.cache))
  for leaf, sh in zip(jax.tree.leaves(engine.policy.abstract_noiser), jax.tree.leaves(engine.policy.noiser_shardings)):
    if leaf.shape[0] == SLOTS:  # per-slot noise factors live with their rows
      assert sh.spec[0] == "data"
  programs = engine.programs()
  assert engine.buckets == [1, 2, 10]  # tokens per data shard: 1 of its 2 rows, both, + a chunk
  steps = len(engine.buckets) * len(engine.spans)
  assert len(programs) == steps + 2  # + reset, noiser build
  with pytest.raises(RuntimeError, match="abstract engine"):
    engine.scheduler.start(0, [5, 6], version=0, member=-1, stream=0)
    engine.step({0: None})


def test_sharded_compile_count_is_bounded(model):
  _, _, params = model
  engine = _engine(model, sharding.make_mesh(data=8))

  def rounds():
    for round_ in range(3):
      rng = np.random.default_rng(round_)
      for slot in engine.scheduler.free_slots():
        engine.scheduler.start(slot, list(rng.integers(4, 64, size=int(rng.integers(1, 30)))), version=0,
                     member=-1, stream=round_ * SLOTS + slot)
      while engine.scheduler.busy():
        for t in engine.step({0: params}):
          engine.scheduler.release(t.slot)

  rounds()
  warm = engine.compilations()
  # one step per (token bucket, span), reset
  assert warm <= len(engine.buckets) * len(engine.spans) + 1
  rounds()  # the same shapes again: nothing new compiles
  assert engine.compilations() == warm


def test_blockwise_attention_in_the_engine_matches_one_block(model, monkeypatch):
  """Keys read 4 at a time (many blocks per span) decode the tokens of whole-span attention."""
  _, _, params = model
  jobs = {s: (0, -1) for s in range(SLOTS)}
  whole = _decode(_engine(model, None), {0: params}, jobs)
  monkeypatch.setattr(softmax, "KV_BLOCK", 4)
  blocks = _decode(_engine(model, sharding.make_mesh(data=4, tensor=2)), {0: params}, jobs)
  assert blocks == whole

"""Full-rank member slices (``ESPolicyBank(member_slices=True)``) on an 8-device CPU mesh: every data
shard runs one member at a time, so the noiser holds one perturbed weight copy per shard (D
copies, not B) and its matmuls gather nothing; the tokens are those of the one-device engine
with one group per slot; the episode runner never mixes members within a shard, runs a shard's
members in turn and completes every episode."""
import os
import re
import shutil
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

from helpers_models import assert_same_turns, es_bank
from jaxes import es, sharding, tokenization
from jaxes.envs import protocol
from jaxes.envs.sandboxes.local_sandbox import LocalSandbox
from jaxes.envs.tasks import generator
from jaxes.es import keys, noiser
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeRunner, EpisodeSpec
from jaxes.rollout.policy_bank import VersionSteps
from jaxes.train.algorithms import evolution

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

IM_END = 3
SLOTS = 8


@pytest.fixture(scope="module")
def model():
  cfg = qwen2.Qwen2Config.preset("tiny-gqa", vocab_size=64)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


def _strategy():
  return es.Strategy(population=8, sigma=0.3, learning_rate=0.1, mode="full")


def _engine(model, mesh, strategy, run_key, version_steps=None, member_slices=False, **kw):
  cfg, graphdef, _ = model
  policy = es_bank(strategy, run_key, version_steps=version_steps, member_slices=member_slices)
  args = dict(num_slots=SLOTS, max_len=64, prefill_chunk=8, max_new_tokens=6, stop_ids=[],
              im_end_id=IM_END, policy=policy, mesh=mesh)
  return Engine(graphdef, cfg, **{**args, **kw})


def _decode(engine, params_by_version, jobs):
  """Two sampled turns per slot with ragged prompts and observations; (tokens, log-probs) of
  every turn by slot."""
  rng = np.random.default_rng(0)
  for slot, (version, member) in jobs.items():
    prompt = list(rng.integers(4, 64, size=int(rng.integers(2, 20))))
    assert engine.scheduler.start(slot, prompt, version=version, member=member, stream=slot,
                        temperature=1.0)
  out = {slot: [] for slot in jobs}
  while engine.scheduler.busy():
    for turn in engine.step(params_by_version):
      out[turn.slot].append((turn.tokens, turn.logprobs))
      if len(out[turn.slot]) == 1:
        observation = np.random.default_rng(100 + turn.slot).integers(4, 64, size=1 + turn.slot)
        assert engine.scheduler.continue_turn(turn.slot, list(observation))
  return out


def test_member_slices_decode_the_one_device_tokens(model):
  """data=4 x tensor=2, two slots per shard, each shard its own (version, member) (one of them
  unperturbed): the tokens and log-probs of the one-device engine whose noiser has a group per
  slot; some calls run compacted rows. The one-device engine decodes 8 steps per call on the
  device (the default), the sliced one a step per call: with 8 its few decode calls all need
  the full batch, and this test is about compacted member slices."""
  _, _, params = model
  strategy = _strategy()
  state0 = strategy.init(params, jax.random.key(1))
  state1, _ = strategy.update(state0, [(0, m, float(m)) for m in range(8)])
  params_by_version = {0: state0.params, 1: state1.params}
  jobs = {s: ((s // 2) % 2, s // 2 - 1) for s in range(SLOTS)}   # shard d: (d % 2, d - 1)
  single = _decode(_engine(model, None, strategy, state0.run_key, compact=False),
                   params_by_version, jobs)
  engine = _engine(model, sharding.make_mesh(data=4, tensor=2), strategy, state0.run_key,
                   member_slices=True, decode_steps=1)
  assert_same_turns(_decode(engine, params_by_version, jobs), single)
  assert engine.stats.rows_computed < engine.stats.rows_total
  assert len({tuple(turns[0][0]) for turns in single.values()}) > 2


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])   # tied head (attend), untied (dense)
def test_in_slices_computes_what_the_per_row_gather_does(preset):
  """Rows in two runs of three, run g all of group g: the sliced noiser's logits (embedding,
  every matmul, the head) equal the gathering noiser's, which tests/es/test_strategy_qwen2.py checks
  against materialised members."""
  cfg = qwen2.Qwen2Config.preset(preset, vocab_size=64)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  strategy = _strategy()
  run_key = jax.random.key(3)
  tokens = np.random.default_rng(0).integers(0, 64, size=(6, 5)).astype(np.int32)
  positions = np.broadcast_to(np.arange(5, dtype=np.int32), (6, 5))
  valid = np.ones((6, 5), bool)

  def logits(params, sliced):
    built = strategy.member_noiser(params, np.array([0, 0], np.int32), np.array([4, -1], np.int32),
                                   np.array([0, 0, 0, 1, 1, 1], np.int32), run_key=run_key)
    built = built.in_slices() if sliced else built
    return qwen2.forward(graphdef, params, tokens, positions, valid, noiser=built)[0]

  logits = jax.jit(logits, static_argnums=1)
  np.testing.assert_allclose(np.asarray(logits(params, True)), np.asarray(logits(params, False)),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="5 rows do not split into \\[2\\] equal slices"):
    strategy.member_noiser(params, np.array([0, 0], np.int32), np.array([4, -1], np.int32),
                           np.zeros(5, np.int32), run_key=run_key).in_slices()


def _local_bytes(shape_dtype, sh) -> int:
  return int(np.prod(sh.shard_shape(shape_dtype.shape))) * shape_dtype.dtype.itemsize


def test_noiser_holds_one_copy_per_shard_and_its_matmuls_gather_nothing(model):
  cfg, _, _ = model
  mesh = sharding.make_mesh(data=4, tensor=2)
  strategy = _strategy()
  per_slot = _engine(model, mesh, strategy, jax.random.key(0), abstract=True)
  sliced = _engine(model, mesh, strategy, jax.random.key(0), abstract=True, member_slices=True)
  params = {keys.param_name(path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(sliced.abstract_params)[0]}
  matrices = [s.name for s in sliced.policy.abstract_noiser.specs if not noiser.is_vector(s)]
  assert len(matrices) == 9
  copy_bytes = 0
  for name in matrices:
    leaf = params[name]
    param_sh = leaf.sharding
    assert per_slot.policy.abstract_noiser.values[name].shape == (SLOTS,) + leaf.shape
    value, sh = sliced.policy.abstract_noiser.values[name], sliced.policy.noiser_shardings.values[name]
    assert value.shape == (4,) + leaf.shape   # D copies, not B
    assert sh.spec == jax.sharding.PartitionSpec("data", *param_sh.spec)
    # Each device holds its own group's copy, split as the parameter is.
    assert _local_bytes(value, sh) == _local_bytes(leaf, param_sh)
    copy_bytes += _local_bytes(leaf, param_sh)
  noiser_bytes = sum(_local_bytes(x, sh) for x, sh in zip(
      jax.tree.leaves(sliced.policy.abstract_noiser), jax.tree.leaves(sliced.policy.noiser_shardings)))
  cache_bytes = sum(_local_bytes(x, x.sharding) for x in jax.tree.leaves(sliced.cache))
  param_bytes = sum(_local_bytes(x, x.sharding) for x in jax.tree.leaves(sliced.abstract_params))
  assert copy_bytes < noiser_bytes < 1.1 * copy_bytes   # one copy, plus per-row vectors
  biggest_layer = cfg.hidden_size * cfg.intermediate_size // mesh.shape["tensor"]
  for engine, copies in ((per_slot, SLOTS // 4), (sliced, 1)):
    programs = engine.programs()
    # The decode buckets (all rows, a quarter): the prefill bucket's portable attention
    # gathers key blocks per token, a gather that is not of weights.
    for name in ("step[t=8,span=64]", "step[t=4,span=64]"):
      compiled = programs[name].compile()
      # The cache and the noiser's copies (+ small per-row arguments); in full mode the step
      # reads no parameter (unused arguments are dropped), the noiser holds every weight.
      args = compiled.memory_analysis().argument_size_in_bytes - cache_bytes
      if copies == 1:
        # Every step program ends in a decode loop (``decode_loop``): its while loop keeps the
        # unused parameters as an argument, buffers that are resident anyway (no memory of
        # their own).
        unused = param_bytes
        assert noiser_bytes <= args < noiser_bytes + unused + 4096, name
      else:
        assert args > copies * copy_bytes, name
      moved = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(
          r"= [a-z0-9]+\[([0-9,]*)\]\{[^}]*\} (?:all-)?gather\(", compiled.as_text())]
      if copies == 1:   # nothing gathers as much as one layer of an MLP matrix's shard
        assert max(moved) < biggest_layer, (name, max(moved))
      else:             # the per-slot noiser gathers its rows' weights
        assert max(moved) >= biggest_layer, (name, max(moved))


def test_engine_refuses_a_second_member_in_a_shard(model):
  _, _, params = model
  engine = _engine(model, sharding.make_mesh(data=4, tensor=2), _strategy(), jax.random.key(0),
                   member_slices=True)
  assert engine.scheduler.start(0, [5, 6], version=0, member=2, stream=0)
  assert engine.scheduler.start(1, [5, 7], version=0, member=2, stream=1)   # the same member: fine
  assert engine.scheduler.start(2, [5, 6], version=0, member=3, stream=2)   # shard 1
  with pytest.raises(ValueError, match=r"slot 3: its data shard runs \(version, member\) \(0, 3\)"):
    engine.scheduler.start(3, [5], version=0, member=4, stream=3)
  with pytest.raises(ValueError, match=r"slot 1 is prefill"):
    engine.scheduler.start(1, [5], version=1, member=2, stream=3)
  assert engine.scheduler.slice_members() == [(0, 2), (0, 3), None, None]
  engine.scheduler.release(0)
  engine.scheduler.release(1)
  assert engine.scheduler.start(0, [5, 6], version=1, member=4, stream=4)   # shard 0 free again
  assert engine.scheduler.slice_members() == [(1, 4), (0, 3), None, None]
  with pytest.raises(ValueError, match="no version_steps"):
    _engine(model, None, _strategy(), jax.random.key(0), member_slices=True,
            version_steps=VersionSteps(lambda *cohort: {}, 8))


def test_builders_use_member_slices_for_full_rank_es_only():
  assert evolution.member_slices(_strategy())
  assert not evolution.member_slices(es.Strategy(population=8, sigma=0.3, learning_rate=0.1,
                                                mode="lowrank"))
  assert not evolution.member_slices(None)


SYSTEM = "Answer with <command>CMD</command>, then <action>done</action>."


def test_runner_runs_a_shards_members_in_turn_and_completes_every_episode(model):
  """Five members x three episodes on data=4 shards of two slots (sandbox results a fixed two
  steps later): no engine step ever sees two members in one shard, a shard's members follow one
  another (a member's episodes there are one unbroken run), and every episode ends."""
  tasks = [generator.generate(f, s, 1) for f in ("permissions", "log_count") for s in range(3)]
  root = tempfile.mkdtemp(prefix="test-slices-")
  os.chmod(root, 0o711)  # the sandbox uid must traverse it
  tok = tokenization.build_tokenizer(16 * [SYSTEM] + [t.instruction for t in tasks], 400,
                                     os.path.join(root, "tok"))
  cfg = qwen2.Qwen2Config.preset("tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                 num_layers=1, num_heads=2, num_kv_heads=2)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  strategy = _strategy()
  state = strategy.init(params, jax.random.key(0))
  engine = Engine(graphdef, cfg, num_slots=SLOTS, max_len=160, prefill_chunk=32, max_new_tokens=8,
                  stop_ids=[], im_end_id=tok.convert_tokens_to_ids("<|im_end|>"),
                  policy=es_bank(strategy, state.run_key, member_slices=True),
                  mesh=sharding.make_mesh(data=4, tensor=2))
  sandbox = LocalSandbox(root_dir=os.path.join(root, "sandboxes"))
  runner = EpisodeRunner(engine, tok, sandbox, workers=4, sandbox_steps=2,
                         make_episode=lambda task, handle: protocol.Episode(task, handle,
                                                                           system_prompt=SYSTEM))
  todo = [EpisodeSpec((m, i), tasks[(3 * m + i) % len(tasks)], 0, m, stream=3 * m + i,
                      temperature=1.0) for m in range(5) for i in range(3)]
  todo.reverse()
  runs = [[] for _ in range(4)]    # per shard: the members it ran, one entry per run
  done = []
  try:
    while len(done) < 15:
      for _ in runner.free_slots()[:len(todo)]:
        runner.submit(todo.pop())
      for d, held in enumerate(engine.scheduler.slice_members()):
        members = {(s.version, s.member) for s in engine.scheduler.slots[2 * d:2 * d + 2] if s.state != "free"}
        assert len(members) <= 1, (d, members)
        if held is not None and (not runs[d] or runs[d][-1] != held):
          runs[d].append(held)
      done += runner.poll({0: state.params}, block=True)
  finally:
    runner.close()
    sandbox.shutdown()
    shutil.rmtree(root, ignore_errors=True)
  assert sorted(r.spec.key for r in done) == [(m, i) for m in range(5) for i in range(3)]
  assert all(r.tokens is not None for r in done)
  for d, members in enumerate(runs):
    assert len(members) == len(set(members)), (d, members)   # one unbroken run per member
  assert sorted({m for members in runs for m in members}) == [(0, m) for m in range(5)]
  assert sum(len(members) > 1 for members in runs) >= 1      # some shard ran members in turn

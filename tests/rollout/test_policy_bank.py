"""All live versions in one engine call: a row of version v + k runs on version v's parameters
plus k low-rank steps (ES low-rank mode, plain SGD) and computes what the materialised version
computes — logits, tokens, log-probs — within float32 rounding; other optimizers fall back to a
call per version; the programs stay few."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers_models import assert_same_turns, es_bank, ragged_turns, tiny_model
from jaxes import es, sharding
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.policy_bank import PolicyBank, VersionSteps

IM_END = 3
SLOTS = 8
POP = 8


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny"])  # untied head / tied embeddings
def any_model(request):
  return tiny_model(request.param, vocab_size=64)


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab_size=64)


def _chain(params, strategy, updates=2):
  """States of versions 0 ... updates, each update on a different cohort, and the cohorts."""
  states, cohorts = [strategy.init(params, jax.random.key(1))], []
  for u in range(updates):
    results = [(u, m, float((m * (u + 3)) % 5)) for m in range(POP)]
    cohorts.append(strategy.cohort(states[-1], results))
    states.append(strategy.update(states[-1], results)[0])
  return states, cohorts


def _stacked(steps, K):
  zero = jax.tree.map(jnp.zeros_like, steps[0])
  return jax.tree.map(lambda *xs: jnp.stack(xs), *(steps + [zero] * (K - len(steps))))


def test_a_version_step_is_the_update_it_regenerates(model):
  _, _, params = model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=2)
  (s0, s1), (cohort,) = _chain(params, strategy, updates=1)
  make = strategy.version_step(params, s0.run_key)
  step = jax.jit(make)(*cohort)
  specs = strategy.leaf_specs(params)
  leaves0, leaves1 = jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)
  assert {s.name for s in specs if s.kind == "lowrank"} == set(step)
  for spec, p0, p1 in zip(specs, leaves0, leaves1):
    if spec.kind == "lowrank":
      a, b = step[spec.name]
      assert a.shape[-1] == POP * 2   # the cohort padded to the population, times the rank
      np.testing.assert_allclose(np.einsum("...ir,...or->...io", a, b), p1 - p0, atol=2e-6)


def test_logits_on_the_base_plus_steps_equal_the_materialised_versions(any_model):
  """Rows of versions 0, 1 and 2 (a chain of two steps) in one forward on version 0's weights
  equal each row's forward on its own materialised version (float32)."""
  cfg, graphdef, params = any_model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  states, cohorts = _chain(params, strategy)
  run_key = states[0].run_key
  make = jax.jit(strategy.version_step(params, run_key))
  steps = [make(*c) for c in cohorts]
  versions = jnp.array([0, 1, 2, 1, 2, 0], jnp.int32)
  members = jnp.array([0, 1, 2, -1, 5, 3], jnp.int32)
  rows = jnp.arange(6, dtype=jnp.int32)
  tokens = jax.random.randint(jax.random.key(2), (6, 5), 4, 64)
  positions = jnp.broadcast_to(jnp.arange(5), (6, 5))
  valid = jnp.ones((6, 5), bool)

  @jax.jit
  def logits(p, noiser):
    return qwen2.forward(graphdef, p, tokens, positions, valid, noiser=noiser)[0]

  own = [strategy.member_noiser(s.params, versions, members, rows, run_key=run_key) for s in states]
  want = np.stack([np.asarray(logits(states[int(v)].params, own[int(v)]))[i]
                   for i, v in enumerate(versions)])
  merged = own[0].with_vectors_of((own[1], own[2]), versions)
  step_rows = (jnp.arange(2)[None, :] < versions[:, None]).astype(jnp.float32)
  got = np.asarray(logits(states[0].params, merged.with_steps(_stacked(steps, 2), step_rows)))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  # The steps matter: version 0's weights alone give other logits for the newer rows.
  plain = np.asarray(logits(states[0].params, merged))
  newer = np.asarray(versions) > 0
  assert np.abs(plain - want)[newer].max() > 1e-2


def _engine(model, strategy, run_key, version_steps=None, **kw):
  cfg, graphdef, _ = model
  policy = es_bank(strategy, run_key, version_steps=version_steps)
  args = dict(num_slots=SLOTS, max_len=64, prefill_chunk=8, max_new_tokens=5, stop_ids=[],
              im_end_id=IM_END, policy=policy)
  return Engine(graphdef, cfg, **{**args, **kw})


@pytest.mark.parametrize("compact", [True, False])
def test_one_call_for_a_chain_of_versions_decodes_the_per_version_calls_tokens(model, compact):
  """Versions 0, 1, 2 live (max_steps 2): one call per step instead of three, the same greedy
  and sampled tokens, log-probs within float32 rounding."""
  _, _, params = model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  states, cohorts = _chain(params, strategy)
  params_by_version = {v: s.params for v, s in enumerate(states)}
  run_key = states[0].run_key
  versions = [0, 1, 2, 0, 1, 2, 2]
  per_version = _engine(model, strategy, run_key, compact=compact)
  merged = _engine(model, strategy, run_key, compact=compact,
                   version_steps=VersionSteps(strategy.version_step(params, run_key), POP, 2))
  for v, cohort in enumerate(cohorts, start=1):
    assert merged.policy.add_step(v, *cohort)
  # Jitted functions can be shared by engines of the same shapes: count what this test adds
  # (the CI worker's earlier tests had left one more program in them).
  compiled_before = merged.compilations()
  want = ragged_turns(per_version, params_by_version, versions)
  got = ragged_turns(merged, params_by_version, versions)
  assert_same_turns(got, want)
  calls = lambda e: e.stats.prefill_calls + e.stats.decode_calls
  assert merged.stats.multi_version_calls > 0 and per_version.stats.multi_version_calls == 0
  assert calls(merged) < calls(per_version)
  assert merged.stats.tokens_decoded == per_version.stats.tokens_decoded
  # Programs: step programs with and without steps, reset, the noiser build, the step build,
  # the stack and the noiser merge — whatever the schedule.
  per_call = len(merged.buckets) * len(merged.spans)
  assert merged.compilations() - compiled_before <= 2 * per_call + 5


def _calls_per_step(engine, params_by_version, versions):
  """Engine calls per step, and multi-version calls, while slots of ``versions`` decode in
  lockstep (same prompt length: every step is one merged decode per group)."""
  for slot, v in enumerate(versions):
    engine.scheduler.start(slot, [5, 6, 7], version=v, member=slot, stream=slot)
  engine.step(params_by_version)                   # the prompts (one prefill per group)
  before = dict(vars(engine.stats))
  engine.step(params_by_version)
  d = {k: v - before[k] for k, v in vars(engine.stats).items()}
  while engine.scheduler.busy():
    engine.step(params_by_version)
  for slot in range(len(versions)):
    engine.scheduler.release(slot)
  return d["decode_calls"], d["multi_version_calls"]


def test_the_base_moves_on_and_unregistered_or_distant_versions_get_their_own_calls(model):
  _, _, params = model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  states, cohorts = _chain(params, strategy)
  every = {v: s.params for v, s in enumerate(states)}
  run_key = states[0].run_key
  make = strategy.version_step(params, run_key)
  # One token per call: each step after the prompts' is one decode call per group.
  engine = _engine(model, strategy, run_key, version_steps=VersionSteps(make, POP, 1),
                   decode_steps=1)
  assert engine.policy.add_step(2, *cohorts[1])
  assert not engine.policy.add_step(1, *(x[:2] for x in cohorts[0][:3]), cohorts[0][3])  # wrong length
  # 1 -> 2 registered, 0 -> 1 not: {0} alone, {1, 2} together.
  assert _calls_per_step(engine, every, [0, 1, 2]) == (2, 1)
  assert engine.policy.add_step(1, *cohorts[0])
  assert _calls_per_step(engine, every, [0, 1, 2]) == (2, 1)   # max_steps 1: {0, 1}, {2}
  # Version 0 retired: 1 is the base of 2; the step 0 -> 1 is dropped with it, so 0 and 1 come
  # back apart.
  assert _calls_per_step(engine, {1: every[1], 2: every[2]}, [1, 2]) == (1, 1)
  assert _calls_per_step(engine, every, [0, 1]) == (2, 0)
  wide = _engine(model, strategy, run_key, version_steps=VersionSteps(make, POP, 2),
                 decode_steps=1)
  for v, cohort in enumerate(cohorts, start=1):
    assert wide.policy.add_step(v, *cohort)
  assert _calls_per_step(wide, every, [0, 1, 2]) == (1, 1)


def test_optimizers_that_break_the_structure_fall_back_to_a_call_per_version(model):
  _, _, params = model
  lowrank = dict(population=POP, sigma=0.3, mode="lowrank", rank=2)
  assert es.Strategy(learning_rate=0.1, **lowrank).steps_are_lowrank
  for strategy in (es.Strategy(learning_rate=0.1, optimizer="adam", **lowrank),
                   es.Strategy(learning_rate=0.1, weight_decay=0.01, **lowrank),
                   es.Strategy(optimizer=optax.sgd(0.1), **lowrank),   # opaque: not known plain
                   es.Strategy(population=POP, sigma=0.3, learning_rate=0.1, mode="full")):
    assert not strategy.steps_are_lowrank
    assert strategy.version_step(params, jax.random.key(0)) is None
  # The adam path in the engine: no steps to add, so each version runs its own call and decodes
  # what an engine without version_steps decodes.
  strategy = es.Strategy(learning_rate=0.1, optimizer="adam", **lowrank)
  states, _ = _chain(params, strategy, updates=1)
  params_by_version = {v: s.params for v, s in enumerate(states)}
  run_key = states[0].run_key
  sgd = es.Strategy(learning_rate=0.1, **lowrank)   # steps of an SGD that is not this run's
  engine = _engine(model, strategy, run_key,
                   version_steps=VersionSteps(sgd.version_step(params, run_key), POP, 1))
  plain = _engine(model, strategy, run_key)
  got = ragged_turns(engine, params_by_version, [0, 1, 0, 1])
  want = ragged_turns(plain, params_by_version, [0, 1, 0, 1])
  assert got == want
  assert engine.stats.multi_version_calls == 0
  assert engine.stats.decode_calls == plain.stats.decode_calls


def test_program_count_with_version_steps_is_twice_the_step_programs(model):
  """The paper config's engine shape (abstract): a step program per token bucket, as many more
  with K = 2 step slots, and the step build, the stack and the noiser merge."""
  cfg, graphdef, params = model
  strategy = es.Strategy(population=POP, sigma=0.3, learning_rate=0.1, mode="lowrank", rank=1)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  args = dict(num_slots=240, max_len=16384, prefill_chunk=512, max_new_tokens=1024, stop_ids=[],
              im_end_id=IM_END, mesh=mesh, abstract=True,
              policy=es_bank(strategy, jax.random.key(0), version_steps=VersionSteps(
                  strategy.version_step(params, jax.random.key(0)), POP, 2)))
  engine = Engine(graphdef, cfg, **args)
  assert engine.buckets == [30, 120, 632]   # a quarter of a shard's rows, all, all + a chunk
  per_call = len(engine.buckets) * len(engine.spans)
  assert per_call == 3
  names = engine.programs()
  steps = [n for n in names if n.startswith("step[")]
  assert len(steps) == 2 * per_call
  assert len([n for n in steps if n.endswith(",steps=2]")]) == per_call
  assert "step[t=1264,span=16384]" in steps and "step[t=60,span=16384,steps=2]" in steps
  assert {"version_step", "stack_steps", "merge_noisers", "noiser", "reset"} <= set(names)


def test_a_bank_of_unperturbed_rows_registers_no_version_step():
  # The trainer hands every update's step to the engine's bank; this one decodes each version
  # from its own parameters.
  assert PolicyBank().add_step(1, np.zeros(2, np.int32), np.zeros(2, np.int32), np.zeros(2, np.float32), 2) is False

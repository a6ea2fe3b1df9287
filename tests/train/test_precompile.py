"""The trainer's start-up compile: every program in parallel threads, a progress bar, errors raised."""
import io

import jax
import jax.numpy as jnp
import pytest

from jaxes.train import compile_cache, precompile


def _lowered(n: int) -> dict:
  x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  return {f"p{i}": jax.jit(lambda a, i=i: jnp.tanh(a @ a) * (i + 1)).lower(x) for i in range(n)}


def test_warm_up_compiles_every_program_in_threads_with_a_progress_bar():
  bar, lines = io.StringIO(), []
  run = precompile.warm_up(lambda: _lowered(3), jobs=2, log=lines.append, file=bar)
  assert [p.name for p in run.programs] == ["p0", "p1", "p2"]   # in the order given
  assert all(p.error is None and p.seconds > 0 for p in run.programs)
  assert "compiling 3 programs: 3/3" in bar.getvalue()
  assert lines == [lines[0]] and lines[0].startswith("compiled 3 programs in ") and "2 thread(s)" in lines[0]


def test_warm_up_off_and_bad_jobs():
  def never_lowered():
    raise AssertionError("jobs=0 lowers nothing")
  assert precompile.warm_up(never_lowered, jobs=0, log=print) is None   # each compiles when first called
  with pytest.raises(ValueError, match=r"config.train.compile_jobs: must be >= 0"):
    precompile.warm_up(lambda: _lowered(1), jobs=-1)


def test_a_program_that_fails_to_compile_raises_its_error():
  class Broken:
    def compile(self):
      raise RuntimeError("no such op")

  with pytest.raises(RuntimeError, match="no such op"):
    precompile.warm_up(lambda: {**_lowered(1), "broken": Broken()}, jobs=2, log=print, progress=False)
  run = precompile.compile_all({"broken": Broken()})
  assert isinstance(run.programs[0].error, RuntimeError) and run.programs[0].result is None


def _compiled(seen: compile_cache.Compiles) -> list[str]:
  """The programs compiled while ``seen`` watched (not read from the persistent cache)."""
  return [name for name, how in seen.programs if how != "read"]


def _tiny_run(algorithm: str, configure=lambda c: None):
  """A tiny model's algorithm object on one device and its real initial state, with shapes no
  other test compiles (a population of 6, a GRPO batch of 6 x 40): its update programs are in the
  suite's cache only if this test put them there."""
  from flax import nnx
  from jaxes import sharding
  from jaxes.models import qwen2
  from jaxes.train import algorithms, builders
  from jaxes.train.defaults import base_config
  from jaxes.train.state import Parts
  c = base_config()
  c.train.algorithm = algorithm
  c.model.preset, c.model.vocab_size, c.es.population = "tiny-gqa", 72, 6
  c.mesh.data = c.mesh.fsdp = c.mesh.tensor = 1
  configure(c)
  model = builders.build_model(c, 72)
  run = algorithms.ALGORITHMS[algorithm](c, Parts(None, model, [], []),
                                         sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  params = nnx.split(qwen2.Qwen2ForCausalLM(model.config, rngs=nnx.Rngs(0)), nnx.Param)[1]
  return run, run.init(params)


def test_the_start_up_compile_warms_the_first_es_update():
  run, state = _tiny_run("es")
  with compile_cache.watch() as warm:
    precompile.warm_up(lambda: precompile.update_programs(run, state), jobs=1, log=print,
                       progress=False)
  assert warm.of("jit(apply)") in (["written"], ["read"])   # "read": a rerun of the suite's cache
  with compile_cache.watch() as first:
    run.strategy.update(state, [(0, m, float(m % 3)) for m in range(6)])
  # ES's update program compiles no more: the call finds the warm-up's executable (in memory, or
  # in the persistent cache in a new process).
  assert "jit(apply)" not in _compiled(first), first.programs


def test_the_start_up_compile_warms_the_first_grpo_step():
  from jaxes import distributed
  from jaxes.rl import batch as rl_batch
  from jaxes.train.algorithms.grpo import batch_sharding
  from jaxes.rl import config as rl_config

  def configure(c):
    c.rollout.temperature, c.rollout.max_len = 1.0, 64
    c.grpo = rl_config.default_config()
    c.grpo.group_size, c.grpo.tasks_per_update, c.grpo.seq_len = 3, 2, 40

  run, state = _tiny_run("grpo", configure)
  with compile_cache.watch() as warm:
    precompile.warm_up(lambda: precompile.update_programs(run, state), jobs=1, log=print,
                       progress=False)
  step = [name for name, how in warm.programs if how != "compiled"]
  assert len(step) == 1, warm.programs
  # The batch as GRPO.update's _batch builds and places one (episodes pad to its rows).
  batch = rl_batch.build_batch([], [], [], seq_len=40, num_rows=6)
  with compile_cache.watch() as first:
    run.learner.step(state.learner, distributed.place(batch, batch_sharding(run.mesh, 6)))
  assert step[0] not in _compiled(first), first.programs


# Engine._placed / _on_every_device place one process's host arrays as programs() lowers them:
# numpy arguments traced with avals of another mesh, and the call's program text differed
# (inner helpers deduplicated otherwise), so it compiled again (issue 32).
def test_every_warmed_engine_program_is_read_back_at_its_real_call():
  from helpers_models import es_bank, ragged_turns, tiny_model
  from jaxes import es
  from jaxes.rollout.engine import Engine
  cfg, graphdef, params = tiny_model(vocab_size=68)   # shapes of this test only
  strategy = es.Strategy(population=6, sigma=0.3, learning_rate=0.5, mode="lowrank", rank=2)
  state = strategy.init(params, jax.random.key(1))
  engine = Engine(graphdef, cfg, num_slots=6, max_len=40, prefill_chunk=4, max_new_tokens=10,
                  stop_ids=[7], im_end_id=3, policy=es_bank(strategy, state.run_key),
                  decode_steps=4)
  with compile_cache.watch() as warm:
    precompile.warm_up(engine.programs, jobs=2, log=print, progress=False)
  warmed = {name for name, _ in warm.programs}
  with compile_cache.watch() as turns:   # decode loops, single steps, compacted rows, resets
    ragged_turns(engine, {0: state.params}, [0] * 6, observation_growth=2)
  assert not warmed & set(_compiled(turns)), (warm.programs, turns.programs)

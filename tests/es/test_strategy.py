"""The seams other modules build on: the ES strategy's public optimiser and engine noiser, the one
abstract-array helper (issue 30)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxes import sharding
from jaxes.es.strategy import Strategy
import helpers_repo


def _params():
  return {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones((4,), jnp.float32)}


def test_strategy_tx_is_the_transformation_its_update_steps_with():
  strategy = Strategy(population=4, sigma=0.1, learning_rate=0.05, optimizer="adam", weight_decay=0.01)
  state = strategy.init(_params(), jax.random.key(0))
  assert isinstance(strategy.tx, optax.GradientTransformation)
  assert jax.tree.structure(strategy.tx.init(_params())) == jax.tree.structure(state.opt_state)
  given = optax.sgd(0.1)
  assert Strategy(population=2, sigma=0.1, optimizer=given).tx is given


def test_engine_noiser_is_member_noiser_under_the_run_key():
  strategy = Strategy(population=4, sigma=0.1, learning_rate=0.05, mode="lowrank", rank=2)
  params, run_key = _params(), jax.random.key(3)
  args = (params, jnp.array([0, 0]), jnp.array([1, 2]), jnp.array([0, 1]))
  got = strategy.engine_noiser(run_key)(*args)
  want = strategy.member_noiser(*args, run_key=run_key)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_abstract_carries_shardings_and_keeps_scalars():
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  rep = NamedSharding(mesh, PartitionSpec())
  tree = {"w": jnp.zeros((3, 4), jnp.bfloat16), "n": 7}
  out = sharding.abstract(tree, {"w": rep, "n": None})
  assert out["n"] == 7
  assert isinstance(out["w"], jax.ShapeDtypeStruct)
  assert (out["w"].shape, out["w"].dtype, out["w"].sharding) == ((3, 4), jnp.bfloat16, rep)


# -- the environment registry ----------------------------------------------------------------------
def test_builders_ask_the_environment_registry(monkeypatch):
  import dataclasses as dc
  import pytest
  from jaxes.train import builders, defaults
  from jaxes.envs import environments
  from jaxes.errors import ConfigError

  assert set(environments.ENVIRONMENTS) >= {"terminal", "webshop"}
  c = defaults.base_config()
  c.env.num_train_tasks, c.env.num_heldout_tasks, c.warmstart.num_tasks = 2, 1, 1
  terminal = builders.training_tasks(c)
  assert [t.limits.max_turns for t in terminal] == [c.env.max_turns] * 2

  @dc.dataclass(frozen=True)
  class Echo(environments.TerminalTasks):   # a new kind: its own tasks and prompt, nothing else edited
    kind: str = "echo"

    def make_tasks(self, config, split, n, start):
      return [f"{split}/{i}" for i in range(start, start + n)]

    def default_system_prompt(self, config):
      return "echo the task"

  monkeypatch.setitem(environments.ENVIRONMENTS, "echo", Echo())
  c.env.kind = "echo"
  assert builders.training_tasks(c) == ["train/1", "train/2"]
  assert builders.heldout_tasks(c) == ["heldout/0"]
  assert builders.episode_factory(c)(terminal[0], None).messages[0]["content"] == "echo the task"
  c.env.kind = "nowhere"
  with pytest.raises(ConfigError, match=r"^config.env.kind: 'nowhere' is not one of \[.*'echo', .*'terminal', 'webshop'.*\]$"):
    builders.make_tasks(c, "train", 1)


# -- the algorithm registry ------------------------------------------------------------------------
def test_algorithms_are_chosen_by_name_and_validated_by_their_own_rules(monkeypatch):
  import pytest
  from jaxes.train import algorithms, config as train_config, defaults
  from jaxes.train.algorithms.evolution import EvolutionStrategies
  from jaxes.errors import ConfigError

  class Frozen(EvolutionStrategies):   # a new algorithm: its module, its rules, no trainer edit
    name, checkpoint_item = "frozen", "frozen"

    @staticmethod
    def check_config(config):
      if config.es.learning_rate != 0.5:
        raise ConfigError("config.es.learning_rate: frozen runs take 0.5")

  c = defaults.base_config()
  c.train.algorithm = "frozen"
  with pytest.raises(ConfigError, match=r"^config.train.algorithm: must be one of \('es', 'grpo', 'sao'\)"):
    train_config.validate(c)
  monkeypatch.setitem(algorithms.ALGORITHMS, "frozen", Frozen)
  with pytest.raises(ConfigError, match=r"^config.es.learning_rate: frozen runs take 0.5$"):
    train_config.validate(c)
  c.es.learning_rate = 0.5
  train_config.validate(c)
  assert algorithms.checkpoint_item("frozen") == "frozen" and algorithms.checkpoint_item("grpo") == "learner"
  assert algorithms.controller_config(c).population == c.es.population
  c.train.algorithm = "grpo"
  c.controller.overage = "weight"
  with pytest.raises(ConfigError, match=r"^config.controller.overage='weight' weighs ES results"):
    algorithms.controller_config(c)


def test_the_loop_and_its_builders_name_no_algorithm():
  """The seam's grep (issue 55): adding an algorithm is a module in jaxes/train/algorithms/, its
  config block and tests; the trainer, its builders and the run state never branch on which."""
  import re
  root = helpers_repo.REPO / "jaxes" / "train"
  from jaxes.train import algorithms
  names = "|".join(map(re.escape, algorithms.ALGORITHMS))
  branch = re.compile(rf"algorithm\s*(==|!=|\bin\b)|\.algorithm\b\s*\)?\s*(==|!=)|[\"']({names})[\"']")
  hits = [f"{path.name}:{n}: {line.strip()}" for path in (root / "trainer.py", root / "builders.py",
                                                           root / "state.py")
          for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
  assert hits == [], hits

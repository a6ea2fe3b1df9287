"""jaxes.train.multihost in one process (tests/train/test_multihost.py launches two): the single-
process Host (the config's mesh, primary, every slot, no exchange); ``shared`` and
``primary_first`` computing once per process role; the ES state's shardings (parameters and
every parameter-shaped optimizer subtree in the rule table's shardings, the rest replicated)."""
import jax
import pytest
from jax.sharding import PartitionSpec

from jaxes import distributed, es, sharding
from jaxes.models import partition
from jaxes.models.qwen2 import Qwen2Config
from jaxes.train import multihost
from jaxes.train.config import load_config_file

from helpers_repo import REPO


def _counting(value):
  calls = []

  def make():
    calls.append(1)
    return value
  return make, calls


@pytest.mark.parametrize("data, devices", [(2, 2), (-1, 8)])
def test_single_process_host_is_primary_owns_every_slot_and_exchanges_nothing(data, devices):
  config = load_config_file(REPO / "configs" / "demo.py")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, 1, 1
  host = multihost.host(config)
  assert dict(host.mesh.shape) == {"data": devices, "fsdp": 1, "tensor": 1}
  assert host.primary and host.owned is None and host.exchange is None
  assert not host.multi_process
  assert host.replicated.mesh is host.mesh and host.replicated.spec == PartitionSpec()


def test_shared_and_primary_first_run_make_once_on_one_process():
  host = multihost.Host(sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), True, None, None)
  for step in (multihost.shared, lambda h, make: multihost.primary_first(h, "tokenizer", make)):
    make, calls = _counting({"transcripts": [1, 2]})
    assert step(host, make) == {"transcripts": [1, 2]} and calls == [1]


def test_shared_sends_the_primarys_value_and_others_do_not_compute_it():
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  # the primary through the real exchange (one process: a copy of its own value)
  primary = multihost.Host(mesh, True, range(0, 2), distributed.allgather_host)
  make, calls = _counting(["ls", "done"])
  assert multihost.shared(primary, make) == ["ls", "done"] and calls == [1]
  # another process hands the exchange None and takes process 0's value
  sent = []

  def gather_from_primary(value):
    sent.append(value)
    return [["from", "primary"], value]
  other = multihost.Host(mesh, False, range(2, 4), gather_from_primary)
  make, calls = _counting(["ls", "done"])
  assert multihost.shared(other, make) == ["from", "primary"]
  assert calls == [] and sent == [None]


def test_primary_first_computes_on_every_process_role():
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  for primary in (True, False):   # one process: the barrier passes at once
    host = multihost.Host(mesh, primary, range(0), distributed.allgather_host)
    make, calls = _counting("tokenizer.json")
    assert multihost.primary_first(host, "tokenizer", make) == "tokenizer.json" and calls == [1]


@pytest.mark.parametrize("optimizer, copies", [("sgd", 1), ("adam", 3)])
def test_es_state_shardings_follow_the_rule_table(optimizer, copies):
  cfg = Qwen2Config.preset("tiny-gqa")
  mesh = sharding.make_mesh(2, 2, 2)
  strategy = es.Strategy(population=4, sigma=0.01, learning_rate=0.01, optimizer=optimizer)
  abstract = jax.eval_shape(lambda p: strategy.init(p, jax.random.key(0)),
                            partition.abstract_params(cfg))
  shardings = multihost.es_state_shardings(abstract, mesh, cfg)
  rule_table = partition.param_shardings(cfg, mesh)
  assert jax.tree.leaves(shardings.params) == jax.tree.leaves(rule_table)
  split = [s for s in jax.tree.leaves(rule_table) if s.spec != PartitionSpec(*[None] * len(s.spec))]
  assert split   # the tiny model has leaves split over fsdp / tensor
  every = jax.tree.leaves(shardings)
  assert len(every) == len(jax.tree.leaves(abstract))
  # the parameters, plus Adam's two moments shaped like them; everything else whole everywhere
  assert sum(s in split for s in every) == copies * len(split)
  assert all(s in jax.tree.leaves(rule_table) or s.spec == PartitionSpec() for s in every)
  assert all(s.mesh is mesh for s in every)

"""The engine on a mesh spanning 2 JAX processes x 2 CPU devices (launch/local.sh: gloo collectives,
loopback coordinator), data x tensor = 2 x 2, against the same mesh shape in this one process:
each process reads only its own data shard's sampled tokens, those are the one-process engine's
tokens, and no host-side exchange runs while the engines step (what both need to take the same
decisions, each row's token count and last token, comes back replicated from the program)."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers_models import ragged_turns
from helpers_train import ROOT

pytestmark = pytest.mark.end_to_end   # every test here launches processes

SCRIPT = r'''
import json, sys
sys.path[:0] = sys.argv[2:]   # tests/ (its helpers) and the test module's folder
from jaxes import distributed
distributed.initialize()
import jax
from jax.experimental import multihost_utils
import test_engine_multiprocess as t
from helpers_models import ragged_turns

assert jax.process_count() == 2 and jax.device_count() == 4
exchanges = []
def counted(name, fn):
  def call(*args, **kwargs):
    exchanges.append(name)
    return fn(*args, **kwargs)
  return call
# Every host-side cross-process exchange there is (the engine used process_allgather before).
multihost_utils.process_allgather = counted("process_allgather", multihost_utils.process_allgather)
multihost_utils.broadcast_one_to_all = counted("broadcast_one_to_all",
                                               multihost_utils.broadcast_one_to_all)
distributed.allgather_host = counted("allgather_host", distributed.allgather_host)
engine, params_by_version = t.engine_and_params(distributed.global_mesh(data=2, tensor=2))
exchanges.clear()   # the engine's build checks its sampling key is the same everywhere (once)
turns = ragged_turns(engine, params_by_version, t.VERSIONS)
out = dict(readable=sorted(engine.readable), exchanges=exchanges,
           stats=dict(tokens_read=engine.stats.tokens_read,
                      tokens_decoded=engine.stats.tokens_decoded,
                      host_syncs=engine.stats.host_syncs),
           turns={s: [[None if x is None else [float(v) for v in x] for x in turn]
                      for turn in ts] for s, ts in turns.items()})
with open(f"{sys.argv[1]}/process-{jax.process_index()}.json", "w") as f:
  json.dump(out, f)
'''

VERSIONS = [0, 0, 0, 0, 0, 0, 0, 0]


def engine_and_params(mesh):
  """A tiny sampled engine of 8 slots on ``mesh`` and its (placed) parameters."""
  from helpers_models import tiny_model
  from jaxes import distributed
  from jaxes.models import partition
  from jaxes.rollout.engine import Engine
  cfg, graphdef, params = tiny_model(vocab_size=64)
  engine = Engine(graphdef, cfg, num_slots=8, max_len=64, prefill_chunk=8, max_new_tokens=5,
                  stop_ids=[], im_end_id=3, mesh=mesh)
  return engine, {0: distributed.place(params, partition.param_shardings(cfg, mesh))}


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_two_processes_read_their_own_rows_and_decode_the_one_process_tokens(tmp_path):
  (tmp_path / "run.py").write_text(SCRIPT)
  done = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--devices", "2", "2", "--",
                         sys.executable, str(tmp_path / "run.py"), str(tmp_path),
                         str(ROOT / "tests"), os.path.dirname(__file__)], cwd=ROOT, env=dict(os.environ),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  from jaxes import sharding
  engine, params_by_version = engine_and_params(
      sharding.make_mesh(data=2, tensor=2, devices=jax.devices()[:4]))
  want = ragged_turns(engine, params_by_version, VERSIONS)
  got = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
  assert [g["readable"] for g in got] == [list(range(4)), list(range(4, 8))]
  for g in got:
    assert g["exchanges"] == []
    assert g["stats"]["host_syncs"] == engine.stats.host_syncs
    assert g["stats"]["tokens_decoded"] == engine.stats.tokens_decoded
    for slot, turns in g["turns"].items():
      slot = int(slot)
      assert len(turns) == len(want[slot]) == 2
      for (tokens, logprobs), (want_tokens, want_logprobs) in zip(turns, want[slot]):
        if slot in g["readable"]:
          assert tokens == [float(x) for x in want_tokens]
          np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        else:   # another process's row: its ids are not read here
          assert tokens is None and logprobs is None
  assert sum(g["stats"]["tokens_read"] for g in got) == engine.stats.tokens_read > 0
  assert all(0 < g["stats"]["tokens_read"] < engine.stats.tokens_read for g in got)

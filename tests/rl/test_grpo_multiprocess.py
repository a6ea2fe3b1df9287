"""The GRPO learner on a mesh that spans 2 JAX processes x 2 CPU devices (launch/local.sh: gloo
collectives, loopback coordinator), data x tensor = 2 x 2: init places the state on the global
mesh (master and moments also over data), two steps run, and the metrics and final parameters
equal the same two steps in this single-device test process."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers_train import ROOT, launch_env
from jaxes.rl.config import GRPOConfig
from jaxes.rl.grpo import GRPOLearner

pytestmark = pytest.mark.end_to_end   # every test here launches processes

SCRIPT = r'''
import json, sys
import jax, numpy as np
from jaxes import distributed
distributed.initialize()
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from jaxes import sharding
from jaxes.models import partition
sys.path[:0] = sys.argv[2:]   # tests/ (its helpers) and the test module's folder
import test_grpo_multiprocess as t

assert jax.process_count() == 2 and jax.device_count() == 4
cfg, graphdef, host_params = t.model()
mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2)
params = distributed.place(host_params, partition.param_shardings(cfg, mesh))
batch = distributed.place(t.host_batch(), NamedSharding(mesh, PartitionSpec("data")))
learner = t.learner(graphdef)
state = learner.init(params)
mu = state.opt_state[1][0].mu
assert all(not x.is_fully_addressable and "data" in jax.tree.leaves(tuple(x.sharding.spec))
           for x in jax.tree.leaves(mu))
metrics = []
for _ in range(2):
  state, m = learner.step(state, batch)
  metrics.append({k: float(np.asarray(v.addressable_data(0))) for k, v in m.items()})
final = multihost_utils.process_allgather(state.params, tiled=True)
if jax.process_index() == 0:
  np.savez(sys.argv[1], *[np.asarray(x, np.float32) for x in jax.tree.leaves(final)])
print("metrics " + json.dumps(metrics), flush=True)
'''


def model():
  from flax import nnx
  from jaxes.models import qwen2
  cfg = qwen2.Qwen2Config.preset("tiny-gqa", vocab_size=64)
  return (cfg, *nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param))


def host_batch():
  from jaxes.rl.batch import Batch
  rng = np.random.default_rng(0)
  rows, seq = 8, 24
  sampled = np.zeros((rows, seq), bool)
  sampled[:, 6:20] = True
  valid = np.arange(seq)[None] < np.array([24, 20, 24, 22, 24, 21, 24, 23])[:, None]
  return Batch(rng.integers(0, 64, (rows, seq)).astype(np.int32), valid, sampled & valid,
               np.where(sampled & valid, -4.0, 0.0).astype(np.float32),
               rng.random(rows).astype(np.float32), np.repeat(np.arange(4), 2).astype(np.int32))


def learner(graphdef):
  # A large Adam epsilon keeps the step smooth in the gradient (near lr * sign(grad) otherwise).
  return GRPOLearner(graphdef, GRPOConfig(learning_rate=1e-3, micro_batches=2, adam_eps=1e-2,
                                          logprob_chunk=8))


def test_two_processes_step_like_one_device(tmp_path):
  (tmp_path / "run.py").write_text(SCRIPT)
  env = launch_env(tmp_path)   # the suite's compile flags and cache; local.sh sets the devices
  out = tmp_path / "final.npz"
  done = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--devices", "2", "2", "--",
                         sys.executable, str(tmp_path / "run.py"), str(out), str(ROOT / "tests"), os.path.dirname(__file__)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
  runs = [json.loads(line.split("metrics ", 1)[1]) for line in done.stdout.splitlines()
          if "] metrics " in line]
  assert len(runs) == 2 and runs[0] == runs[1]   # both processes report the same replicated metrics

  cfg, graphdef, params = model()
  one = jax.devices()[0]
  local = learner(graphdef)
  state = local.init(jax.device_put(params, one))
  batch = jax.device_put(host_batch(), one)
  for got in runs[0]:
    state, want = local.step(state, batch)
    for key in ("loss", "pg_loss", "grad_norm", "clip_fraction", "ratio", "tokens", "episodes"):
      np.testing.assert_allclose(got[key], float(want[key]), rtol=1e-4, atol=1e-6, err_msg=key)
  final = np.load(out)
  leaves = jax.tree.leaves(state.params)
  assert len(final.files) == len(leaves)
  for i, x in enumerate(leaves):
    np.testing.assert_allclose(final[f"arr_{i}"], np.asarray(x), rtol=0, atol=1e-6)

"""Device memory of one GRPO learner step beside one ES update, for the same model, from XLA's
compiled memory analysis (abstract shapes: nothing is allocated, so 0.5B-7B shapes compile on a
laptop CPU).

  JAX_PLATFORMS=cpu python benchmarks/grpo_memory.py [--preset qwen2.5-0.5b] [--param_dtype bfloat16]
      [--rows 32] [--seq_len 1024] [--micro_batches 1,8,32] [--population 32]
  JAX_PLATFORMS=cpu python benchmarks/grpo_memory.py --demo   # the CPU demo's shapes

GRPO step: params (+ a float32 master copy when params are bf16) + AdamW moments + a batch of
``rows`` episodes x ``seq_len`` tokens, gradients accumulated over micro-batches; the state is
donated, so its input and output buffers alias. ES update (``jaxes.es.update.apply``, the jitted
function ``Strategy.update`` runs): params + SGD state, the direction regenerated from keys
(full-rank and low-rank). Both also need the rollout engine (params + KV cache), not counted.
Also the gradient of one micro-batch's teacher-forced log-probs with and without the whole
forward under ``jax.checkpoint``. Every GRPO program is compiled twice: as the learner runs now
(each layer under ``jax.checkpoint``, ``attention.causal`` blockwise over query blocks of
``attention.softmax.KV_BLOCK`` when the sequence is longer, log-probs ``grpo.logprob_chunk`` positions
at a time) and as it ran before all three (``_before`` rows: no remat, one dense softmax over
the whole sequence, the whole [rows, seq_len, vocab] logits at once).

Prints a table, then one JSON line with every number.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxes.es import noise, update
from jaxes.models import qwen2
from jaxes.models.attention import softmax
from jaxes.rl import objective
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig
from jaxes.rl.grpo import GRPOLearner


def analysis(compiled) -> dict:
  m = compiled.memory_analysis()
  out = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
             aliased=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
  out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
  return out


@contextlib.contextmanager
def attention_path(dense: bool, seq_len: int):
  """The uncached forward's attention: one dense softmax over the whole sequence (``dense``:
  the learner before ``attention.causal``'s query blocks), or the default."""
  block = softmax.KV_BLOCK
  softmax.KV_BLOCK = max(block, seq_len) if dense else block
  try:
    yield
  finally:
    softmax.KV_BLOCK = block


def grpo_memory(graphdef, params, rows, seq_len, micro_batches, before=False) -> dict:
  with attention_path(before, seq_len):
    return _grpo_memory(graphdef, params, rows, seq_len, micro_batches, remat=not before,
                        chunk=0 if before else GRPOConfig.logprob_chunk)


def _grpo_memory(graphdef, params, rows, seq_len, micro_batches, remat, chunk) -> dict:
  learner = GRPOLearner(graphdef, GRPOConfig(micro_batches=micro_batches, remat=remat, logprob_chunk=chunk))
  state = jax.eval_shape(learner.init, params)
  S = jax.ShapeDtypeStruct
  batch = Batch(S((rows, seq_len), jnp.int32), S((rows, seq_len), bool), S((rows, seq_len), bool),
                S((rows, seq_len), jnp.float32), S((rows,), jnp.float32), S((rows,), jnp.int32))
  return analysis(learner.lower(state, batch).compile())


def logprob_grad_memory(graphdef, params, rows, seq_len, remat) -> dict:
  """Gradient of the teacher-forced log-probs of one micro-batch (dense attention), the whole
  forward under ``jax.checkpoint`` (``remat="whole"``: what remat can do from outside the model's
  layer scan), each layer under it (``"layers"``), or neither (None)."""
  def total(p, tokens, valid):
    return objective.sequence_logprobs(graphdef, p, tokens, valid, 1.0, 1.0,
                                       remat=remat == "layers").sum()
  fn = jax.jit(jax.grad(jax.checkpoint(total) if remat == "whole" else total))
  S = jax.ShapeDtypeStruct
  return analysis(fn.lower(params, S((rows, seq_len), jnp.int32), S((rows, seq_len), bool)).compile())


def es_memory(params, population, mode) -> dict:
  cfg = noise.NoiseConfig(mode=mode, rank=1)
  tx = optax.chain(optax.add_decayed_weights(0.0), optax.sgd(1e-3))
  opt_state = jax.eval_shape(tx.init, jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params))
  n = population // 2  # antithetic pairs share one key
  fn = jax.jit(functools.partial(update.apply, cfg=cfg, tx=tx))
  key = jax.eval_shape(lambda: jax.random.key(0))
  lowered = fn.lower(params, opt_state, key, jax.ShapeDtypeStruct((n,), jnp.int32),
                     jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32),
                     jax.ShapeDtypeStruct((), jnp.int32))
  return analysis(lowered.compile())


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen2.5-0.5b")
  parser.add_argument("--param_dtype", default="bfloat16")
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--micro_batches", default="1,8,32")
  parser.add_argument("--population", type=int, default=32)
  parser.add_argument("--demo", action="store_true",
                      help="the CPU demo's model and batch shapes (configs/demo_grpo.py, configs/demo.py)")
  args = parser.parse_args()
  overrides = {}
  if args.demo:
    import os
    from jaxes.train.config import load_config_file
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "demo_grpo.py"))
    overrides = {k: c.model[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                         "num_heads", "num_kv_heads") if c.model[k]}
    args.preset, args.param_dtype = c.model.preset, c.model.param_dtype
    args.rows, args.seq_len = c.grpo.group_size * c.grpo.tasks_per_update, c.rollout.max_len
    args.micro_batches, args.population = f"1,{c.grpo.micro_batches},{args.rows}", c.es.population
  cfg = qwen2.Qwen2Config.preset(args.preset, param_dtype=args.param_dtype, dtype=args.param_dtype,
                                 **overrides)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)
  param_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
  rows = {}
  for mode in ("full", "lowrank"):
    t = time.perf_counter()
    rows[f"es_update_{mode}"] = es_memory(params, args.population, mode)
    rows[f"es_update_{mode}"]["compile_s"] = time.perf_counter() - t
  for k in (int(x) for x in args.micro_batches.split(",")):
    for before in (True, False):
      name = f"grpo_step_mb{k}{'_before' if before else ''}"
      t = time.perf_counter()
      rows[name] = grpo_memory(graphdef, params, args.rows, args.seq_len, k, before)
      rows[name]["compile_s"] = time.perf_counter() - t
  micro_rows = args.rows // max(int(x) for x in args.micro_batches.split(","))
  with attention_path(True, args.seq_len):
    for remat in (None, "whole", "layers"):
      rows[f"logprob_grad_{micro_rows}rows{'_remat_' + remat if remat else ''}"] = logprob_grad_memory(
        graphdef, params, micro_rows, args.seq_len, remat)
  gib = 2 ** 30
  print(f"{args.preset}{' (demo)' if args.demo else ''} {args.param_dtype}: params {param_bytes / gib:.3f} GiB; GRPO batch {args.rows} x "
        f"{args.seq_len} tokens; ES population {args.population}")
  print(f"{'program':28s} {'arguments':>10s} {'outputs':>10s} {'aliased':>10s} {'temp':>10s} {'peak GiB':>10s} {'x params':>9s}")
  for name, r in rows.items():
    print(f"{name:28s} {r['arguments'] / gib:10.3f} {r['outputs'] / gib:10.3f} {r['aliased'] / gib:10.3f} "
          f"{r['temp'] / gib:10.3f} {r['peak'] / gib:10.3f} {r['peak'] / param_bytes:9.2f}")
  print(json.dumps(dict(preset=args.preset, demo=args.demo, param_dtype=args.param_dtype, rows_per_batch=args.rows,
                        seq_len=args.seq_len, population=args.population, param_bytes=param_bytes,
                        machine=platform.machine(), backend=jax.default_backend(),
                        date=time.strftime("%Y-%m-%d"), programs=rows)))


if __name__ == "__main__":
  main()

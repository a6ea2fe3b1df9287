"""How far ES perturbations move a warm-started policy's format decision, and what they cost.

  python benchmarks/format_lever.py --init_from runs/demo [--config configs/demo.py]
      [--specs lowrank:0.01 lowrank:0.015 full:0.01 lowrank:0.02:embedding] [--es_updates 6]

Teacher-forced, on oracle transcripts of the held-out tasks (no decoding, no sandbox after the
transcripts are made). The *format decision* is the first token of the first reply: its margin is
log p(first token of ``<command>``) - log p(first token of a fenced block). For each spec
``mode:sigma[:frozen regexes]`` and each antithetic pair of a population of 16:

  * ``shift``: half the margin difference between the two partners, per task (the part linear in
    the perturbation); reported as its std over pairs and tasks, and the std of its per-pair mean
    over tasks (equal when a perturbation moves every task alike);
  * ``curvature``: mean margin of the two partners minus the unperturbed margin;
  * ``dNLL``: mean change of the assistant-token loss of everything after the first token;
  * ``flips``: fraction of tasks whose greedy first token changes.

``--es_updates N`` then runs N ES updates (population 8, the config's learning rate, first spec)
whose fitness is the fraction of held-out prompts whose greedy first token opens ``<command>``:
whether ES can move the decision when it is measured on many tasks at once.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxes import es
from jaxes.envs import make_sandbox
from jaxes.envs.tasks import oracle
from jaxes.models import qwen2
from jaxes.rollout import chat
from jaxes.train import builders
from jaxes.train.config import load_config_file
from jaxes.train.policy import load_policy


def load(config_path: str, init_from: str, num_tasks: int):
  c = load_config_file(config_path)
  policy = load_policy(init_from, version=0)
  sandbox = make_sandbox("local")
  try:
    transcripts = oracle.oracle_transcripts(builders.make_tasks(c, "heldout", num_tasks), sandbox,
                                               builders.episode_factory(c), c.env.sandbox_workers)
  finally:
    sandbox.shutdown()
  return c, policy.tokenizer, policy.graphdef, policy.params, transcripts


def make_stats(tok, graphdef, transcripts):
  encoded = [chat.transcript_ids(tok, m) for m in transcripts]
  length = max(len(ids) for ids, _ in encoded)
  ids = np.zeros((len(encoded), length), np.int32)
  targets = np.zeros((len(encoded), length), bool)
  decision = np.zeros(len(encoded), np.int32)   # position whose logits choose the first reply token
  for k, (row, assistant) in enumerate(encoded):
    ids[k, :len(row)] = row
    targets[k, :len(row) - 1] = assistant[1:]
    decision[k] = assistant.index(True) - 1
  rows = np.arange(len(encoded))
  command_id = ids[rows, decision + 1]
  fence_id = tok.encode("```bash\n", add_special_tokens=False)[0]
  targets[rows, decision] = False   # the loss covers what follows the decision

  @jax.jit
  def stats(params):
    positions = jnp.broadcast_to(jnp.arange(length), ids.shape)
    logits, _ = qwen2.forward(graphdef, params, jnp.asarray(ids), positions, jnp.ones(ids.shape, bool))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(logp[:, :-1], jnp.asarray(ids)[:, 1:, None], -1)[..., 0]
    mask = jnp.asarray(targets[:, :-1], jnp.float32)
    at = logp[rows, decision]
    margin = at[rows, command_id] - at[rows, fence_id]
    return margin, jnp.sum(nll * mask) / jnp.sum(mask)

  return stats


def parse_spec(spec: str):
  mode, sigma, *frozen = spec.split(":")
  return mode, float(sigma), [f for f in ",".join(frozen).split(",") if f]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="configs/demo.py")
  ap.add_argument("--init_from", required=True)
  ap.add_argument("--tasks", type=int, default=64)
  ap.add_argument("--specs", nargs="+", default=["lowrank:0.01", "lowrank:0.015", "full:0.015"])
  ap.add_argument("--es_updates", type=int, default=0)
  a = ap.parse_args()
  c, tok, graphdef, params, transcripts = load(a.config, a.init_from, a.tasks)
  stats = make_stats(tok, graphdef, transcripts)
  base_margin, base_nll = (np.asarray(x) for x in stats(params))
  print(f"{len(transcripts)} held-out oracle transcripts; unperturbed: margin mean "
        f"{base_margin.mean():+.2f}, median |margin| {np.median(np.abs(base_margin)):.2f}, first "
        f"token opens <command> on {np.mean(base_margin > 0):.0%}; loss {base_nll:.3f}")
  print("| spec | shift std | per-pair mean shift std | curvature | dNLL | flips |")
  print("| --- | ---: | ---: | ---: | ---: | ---: |")
  for spec in a.specs:
    mode, sigma, frozen = parse_spec(spec)
    strategy = es.Strategy(population=16, sigma=sigma, learning_rate=1.0, mode=mode, rank=c.es.rank,
                           frozen=frozen)
    state = strategy.init(params, jax.random.key(0))
    shift, curvature, dnll, flips = [], [], [], []
    for pair in range(8):
      (m_plus, l_plus), (m_minus, l_minus) = (
          [np.asarray(x) for x in stats(strategy.perturbed(state, (0, 2 * pair + s)))] for s in (0, 1))
      shift.append((m_plus - m_minus) / 2)
      curvature.append(np.mean((m_plus + m_minus) / 2 - base_margin))
      dnll.append((l_plus + l_minus) / 2 - base_nll)
      flips.append(np.mean([(m > 0) != (base_margin > 0) for m in (m_plus, m_minus)]))
    shift = np.array(shift)
    print(f"| {spec} | {shift.std():.3f} | {shift.mean(axis=1).std():.3f} | {np.mean(curvature):+.3f} "
          f"| {np.mean(dnll):+.3f} | {np.mean(flips):.3f} |", flush=True)

  if a.es_updates:
    mode, sigma, frozen = parse_spec(a.specs[0])
    strategy = es.Strategy(population=8, sigma=sigma, learning_rate=c.es.learning_rate, mode=mode,
                           rank=c.es.rank, shaping=c.es.shaping, frozen=frozen)
    state = strategy.init(params, jax.random.key(0))
    for _ in range(a.es_updates):
      version = int(state.version)
      results = [(version, m, float(np.mean(np.asarray(stats(strategy.perturbed(state, (version, m)))[0]) > 0)))
                 for m in range(8)]
      state, info = strategy.update(state, results)
      margin, nll = (np.asarray(x) for x in stats(state.params))
      print(f"ES update {version + 1} ({a.specs[0]}, lr {c.es.learning_rate}): first token opens "
            f"<command> on {np.mean(margin > 0):.0%}, margin mean {margin.mean():+.2f}, loss {nll:.3f}, "
            f"update norm {info['update_norm']:.2f}", flush=True)


if __name__ == "__main__":
  main()

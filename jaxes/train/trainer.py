"""The ES trainer: rollout engine + agent protocol + sandbox threads + controller + ES update.

One loop on the host: hand free slots the controller's jobs, advance every episode by one engine
step (sandbox work runs on worker threads meanwhile), report finished episodes, and apply every
update the controller declares due (its cohort of ``(version, member, fitness)`` results, stale
ones included, with staleness tags). Each update writes a metrics line, and every
``checkpoint_every`` updates a checkpoint; held-out evaluation of the unperturbed policy runs
before training, every ``eval_every`` updates and at the end.

Resume: rerun the same command with the same ``--workdir``. The newest checkpoint restores the ES
state (params, optimizer state, version, run key), the parameters of older versions still needed
by jobs in flight, the controller (which reissues its in-flight jobs, with their task choice
deterministic from the seed) and the evaluation history. Token sampling is keyed by job id (by
antithetic pair with common random numbers), so a reissued job decodes exactly what it would have.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import zlib
from collections import Counter
from typing import Callable

import jax
import numpy as np
from flax import nnx
from ml_collections import config_dict

from jaxes import es
from jaxes.es import keys
from jaxes.controller import Controller, ControllerConfig
from jaxes.envs import make_sandbox
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine
from jaxes.rollout.episodes import EpisodeRunner, EpisodeSpec
from jaxes.train import checkpoint, metrics, warmstart
from jaxes.train.config import ConfigError, validate

EVAL_STREAM_BASE = 1 << 30     # sampling streams of evaluation episodes (training: training_stream)
PAIR_STREAM_BASE = 1 << 31     # sampling streams shared by antithetic partners


def training_stream(job, antithetic: bool, common_random_numbers: bool) -> int:
  """The sampling stream of a training episode. With common random numbers both members of an
  antithetic pair (which the controller gives the same task) decode with the same stream, so at
  temperature > 0 their rewards differ through the perturbation, not through sampling luck. The
  stream depends only on (version, pair, episode), so a reissued job decodes the same tokens."""
  if not (common_random_numbers and antithetic):
    return job.job_id
  pair = keys.pair_id(job.member, antithetic)
  return PAIR_STREAM_BASE + zlib.crc32(f"{job.version}/{pair}/{job.episode}".encode()) % (1 << 30)


def mesh_shape(config, num_devices: int) -> tuple[int, int, int]:
  sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f"config.mesh: {num_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) > num_devices:
    raise ConfigError(f"config.mesh: data x fsdp x tensor = {math.prod(sizes)} exceeds the "
                      f"{num_devices} available devices")
  return tuple(sizes)


def make_tasks(config, split: str, n: int, start: int = 0):
  """Generated tasks ``start .. start + n - 1`` of a split: task i is family i mod F of the
  configured families (all by default) at ``env.difficulty``, or cycling through 1..3 when it is
  0 (as ``generator.split``)."""
  from jaxes.envs import generator
  families = [f.strip() for f in config.env.families.split(",") if f.strip()] or list(generator.FAMILIES)
  tasks = []
  for i in range(start, start + n):
    difficulty = config.env.difficulty or generator.DIFFICULTIES[(i // len(families)) % 3]
    task = generator.generate(families[i % len(families)], generator.split_seed(split, i, config.seed),
                              difficulty)
    tasks.append(dataclasses.replace(
        task, limits=dataclasses.replace(task.limits, max_turns=config.env.max_turns)))
  return tasks


class Trainer:
  """``Trainer(config, workdir).run()``. ``sandbox`` overrides the configured backend (it is shut
  down at the end either way); ``on_update(record)`` is called after each update's metrics line."""

  def __init__(self, config: config_dict.ConfigDict, workdir: str, *, sandbox=None,
               on_update: Callable[[dict], None] | None = None, log: Callable[[str], None] = print):
    validate(config)
    self.config, self.workdir, self.log = config, os.path.abspath(workdir), log
    self._sandbox, self._on_update = sandbox, on_update
    os.makedirs(self.workdir, exist_ok=True)

  # -- set-up ---------------------------------------------------------------------------------
  def _episode(self, task, handle):
    from jaxes.envs import protocol
    return protocol.Episode(task, handle, partial_credit=self.config.env.partial_credit,
                            parse_error_penalty=self.config.env.parse_error_penalty,
                            system_prompt=self.config.env.system_prompt or protocol.SYSTEM_PROMPT)

  def _tokenizer(self, transcripts):
    from jaxes import tokenization
    c = self.config
    path = c.tokenizer.path or c.model.path or (c.warmstart.init_from and os.path.join(c.warmstart.init_from, "tokenizer"))
    if path:
      return tokenization.load_tokenizer(path)
    out = os.path.join(self.workdir, "tokenizer")
    if os.path.isdir(out) and os.listdir(out):
      return tokenization.load_tokenizer(out)
    from jaxes.envs import protocol
    # Text every episode repeats is weighted up so BPE merges compress it (shorter prompts).
    texts = 64 * [c.env.system_prompt or protocol.SYSTEM_PROMPT, protocol.PARSE_ERROR_OBSERVATION, "<action>done</action>",
                  "Command executed successfully. Output: \n\n(exit_code=0)",
                  "Command failed. Output: \n\n(exit_code=1)"]
    texts += [t.instruction for t in self.train_tasks]
    for messages in transcripts:
      texts += [m["content"] for m in messages[1:]]
    self.log(f"building a {c.tokenizer.vocab_size}-token BPE tokenizer from {len(texts)} texts")
    return tokenization.build_tokenizer(texts, c.tokenizer.vocab_size, out)

  def _model(self):
    c = self.config
    if c.model.path:
      from jaxes import sharding
      from jaxes.models import hf
      mesh = sharding.make_mesh(*mesh_shape(c, len(jax.devices())),
                                devices=jax.devices()[:math.prod(mesh_shape(c, len(jax.devices())))])
      cfg, graphdef, params = hf.load(c.model.path, mesh=mesh, param_dtype=c.model.param_dtype,
                                      dtype=c.model.dtype)
      return cfg, graphdef, params
    overrides = {k: c.model[k] for k in ("hidden_size", "intermediate_size", "num_layers",
                                         "num_heads", "num_kv_heads") if c.model[k]}
    vocab = c.model.vocab_size or len(self.tok)
    if vocab < len(self.tok):
      raise ConfigError(f"config.model.vocab_size: {vocab} < the tokenizer's {len(self.tok)} tokens")
    cfg = qwen2.Qwen2Config.preset(c.model.preset, vocab_size=vocab, dtype=c.model.dtype,
                                   param_dtype=c.model.param_dtype,
                                   max_position_embeddings=max(c.rollout.max_len, c.warmstart.seq_len))
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(c.seed)), nnx.Param)
    return cfg, graphdef, params

  def _strategy(self) -> es.Strategy:
    e = self.config.es
    return es.Strategy(population=e.population, sigma=e.sigma, learning_rate=e.learning_rate,
                       mode=e.mode, rank=e.rank, antithetic=e.antithetic, shaping=e.shaping,
                       sigma_schedule=e.sigma_schedule,
                       sigma_final=e.sigma_final if e.sigma_schedule != "constant" else None,
                       schedule_steps=self.config.train.num_updates if e.sigma_schedule != "constant" else None,
                       optimizer=e.optimizer, weight_decay=e.weight_decay,
                       perturb_vectors=e.perturb_vectors,
                       frozen=[p.strip() for p in e.frozen.split(",") if p.strip()])

  # -- the run --------------------------------------------------------------------------------
  def run(self) -> dict:
    c = self.config
    mesh_shape(c, len(jax.devices()))
    self.sandbox = self._sandbox or make_sandbox(c.env.sandbox)
    self.runner = None
    ckpt = None
    try:
      # The warm start (a stand-in for an Instruct checkpoint) sees the first train-split tasks;
      # ES trains on the ones after them, tasks the policy has not been taught.
      self.train_tasks = make_tasks(c, "train", c.env.num_train_tasks, start=c.warmstart.num_tasks)
      self.heldout_tasks = make_tasks(c, "heldout", c.env.num_heldout_tasks)
      ckpt = checkpoint.Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=c.train.keep_checkpoints)
      resuming = bool(ckpt.steps())
      transcripts = []
      needs_tokenizer = not (c.tokenizer.path or c.model.path or c.warmstart.init_from
                             or os.path.isdir(os.path.join(self.workdir, "tokenizer")))
      if (c.warmstart.steps and not resuming and not c.warmstart.init_from) or needs_tokenizer:
        warm_tasks = make_tasks(c, "train", max(c.warmstart.num_tasks, 1))
        t = time.perf_counter()
        transcripts = warmstart.oracle_transcripts(warm_tasks, self.sandbox, self._episode,
                                                   c.env.sandbox_workers)
        self.log(f"{len(transcripts)} oracle transcripts in {time.perf_counter() - t:.1f}s")
        transcripts = warmstart.off_protocol(transcripts, c.warmstart.off_protocol_fraction, c.seed)
      self.tok = self._tokenizer(transcripts)
      self.model_config, self.graphdef, params = self._model()
      self.strategy = self._strategy()
      self.timings = {}
      if c.warmstart.steps and not resuming and not c.warmstart.init_from:
        t = time.perf_counter()
        tokens, mask = warmstart.encode(self.tok, transcripts, c.warmstart.seq_len)
        params, history = warmstart.train(self.graphdef, params, tokens, mask, steps=c.warmstart.steps,
                                          batch_size=c.warmstart.batch_size,
                                          learning_rate=c.warmstart.learning_rate, seed=c.seed,
                                          log=self.log)
        self.timings["warmstart_s"] = time.perf_counter() - t
      if c.warmstart.init_from and not resuming:
        params = self._params_from(c.warmstart.init_from, params)
      state = self.strategy.init(params, jax.random.key(c.seed))
      self.ctl = Controller(ControllerConfig.from_config(
          c.controller, population=c.es.population, seed=c.seed, antithetic=c.es.antithetic),
          num_tasks=len(self.train_tasks))
      self.evals: list[dict] = []
      self.params = {0: state.params}
      if resuming:
        state = self._restore(ckpt, state)
      self.state = state
      self._build_runner()
      writer = metrics.MetricsWriter(self.workdir, resume_version=int(state.version))
      try:
        return self._loop(ckpt, writer)
      finally:
        writer.close()
    finally:
      if self.runner is not None:
        self.runner.close()
      self.sandbox.shutdown()
      if ckpt is not None:
        ckpt.close()

  def _params_from(self, workdir: str, like):
    """The version-0 parameters of another run (share one warm start across ES runs)."""
    src = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
      probe = self._strategy().init(like, jax.random.key(0))
      _, tree, _ = src.restore(lambda host: {"es": probe, "old": {str(v): like for v in host["old_versions"]}}, step=0)
    finally:
      src.close()
    self.log(f"initial parameters from {workdir} (version 0)")
    return tree["es"].params

  def _restore(self, ckpt, state):
    def target(host):
      return {"es": state, "old": {str(v): state.params for v in host["old_versions"]}}
    restored = ckpt.restore(target)
    if restored is None:
      raise RuntimeError(f"no restorable checkpoint in {ckpt.directory}")
    step, tree, host = restored
    self.ctl = Controller.from_state_dict(host["controller"])
    self.evals = host["evals"]
    self.timings = host.get("timings", {})
    self.params = {int(v): p for v, p in tree["old"].items()}
    self.params[int(tree["es"].version)] = tree["es"].params
    self.log(f"resumed from checkpoint at version {step}")
    return tree["es"]

  def _save(self, ckpt):
    version = int(self.state.version)
    old = sorted(v for v in self.params if v != version)
    ckpt.save(version, {"es": self.state, "old": {str(v): self.params[v] for v in old}},
              {"controller": self.ctl.state_dict(), "evals": self.evals, "old_versions": old,
               "timings": self.timings})

  def _build_runner(self):
    c = self.config
    run_key = self.state.run_key
    strategy = self.strategy

    def make_noiser(params, versions, members, row_group):
      return strategy.member_noiser(params, versions, members, row_group, run_key=run_key)

    im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
    stop = [i for i in (self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|endoftext|>"))
            if isinstance(i, int) and i >= 0]
    engine = Engine(self.graphdef, self.model_config, num_slots=c.rollout.num_slots,
                    max_len=c.rollout.max_len, prefill_chunk=c.rollout.prefill_chunk,
                    max_new_tokens=c.rollout.max_new_tokens, stop_ids=stop, im_end_id=im_end,
                    make_noiser=make_noiser, seed=c.seed)
    self.runner = EpisodeRunner(engine, self.tok, self.sandbox, make_episode=self._episode,
                                workers=c.env.sandbox_workers, sandbox_steps=c.rollout.sandbox_steps)

  def _prune_params(self):
    keep = set(self.ctl.live_versions()) | self.runner.live_versions() | {int(self.state.version)}
    for v in [v for v in self.params if v not in keep]:
      del self.params[v]

  # -- evaluation -----------------------------------------------------------------------------
  def evaluate(self) -> dict:
    """Held-out success of the unperturbed current policy over eval.num_tasks x eval.seeds
    episodes. Training episodes already in flight keep running (their results are reported)."""
    c = self.config
    version = int(self.state.version)
    todo = [EpisodeSpec(("eval", s, i), task, version, -1,
                        EVAL_STREAM_BASE + s * len(self.heldout_tasks) + i, c.eval.temperature,
                        c.rollout.top_p)
            for s in range(c.eval.seeds) for i, task in enumerate(self.heldout_tasks[:c.eval.num_tasks])]
    todo.reverse()
    passed = np.zeros((c.eval.seeds, c.eval.num_tasks))
    rewards = np.zeros((c.eval.seeds, c.eval.num_tasks))
    remaining, t, failures = len(todo), time.perf_counter(), Counter()
    while remaining:
      for _ in self.runner.free_slots()[:len(todo)]:
        self.runner.submit(todo.pop())
      for r in self.runner.poll(self.params, block=True):
        if r.spec.key[0] == "eval":
          _, s, i = r.spec.key
          passed[s, i], rewards[s, i] = float(r.passed), r.reward or 0.0
          failures[r.failure or ("passed" if r.passed else "wrong")] += 1
          remaining -= 1
        else:
          self._report(r)
    per_task = passed.mean(axis=0)  # s.e. over held-out tasks of the per-task success rate
    success, stderr = metrics.mean_stderr(per_task) if c.eval.num_tasks else (float("nan"), float("nan"))
    result = {"version": version, "success": success, "stderr": stderr,
              "reward": float(rewards.mean()) if rewards.size else float("nan"),
              "episodes": int(passed.size), "seconds": time.perf_counter() - t,
              "failures": dict(failures), "per_task": per_task.tolist()}
    self.evals.append(result)
    self.log(f"held-out eval at version {version}: success {success:.3f} ± {stderr:.3f} "
             f"({passed.size} episodes, {result['seconds']:.0f}s)")
    return result

  # -- training -------------------------------------------------------------------------------
  def _report(self, r):
    job = r.spec.key[1]
    self.ctl.report(job.job_id, reward=r.reward, failure=r.failure)
    if r.reward is not None:
      acc = self._acc
      acc["episodes"] += 1
      acc["passed"] += int(r.passed)
      acc["reward"] += r.reward
      acc["turns"] += r.turns
      acc["truncated"] += int(r.truncated)
      acc["env_worker_s"] += r.env_s
    self._acc["failures"][r.failure or "none"] += 1

  def _new_acc(self):
    s = self.runner.engine.stats
    return {"episodes": 0, "passed": 0, "reward": 0.0, "turns": 0, "truncated": 0,
            "env_worker_s": 0.0, "failures": Counter(), "t": time.perf_counter(),
            "decode_s": self.runner.decode_s, "wait_s": self.runner.wait_s, "update_s": 0.0,
            "rows_busy": s.rows_busy, "rows_total": s.rows_total, "tokens": s.tokens_decoded}

  def _issue_jobs(self):
    c = self.config
    free = self.runner.free_slots()
    if not free:
      return
    for job in self.ctl.next_jobs(len(free)):
      stream = training_stream(job, c.es.antithetic, c.rollout.common_random_numbers)
      self.runner.submit(EpisodeSpec(("train", job), self.train_tasks[job.task], job.version,
                                     job.member, stream, c.rollout.temperature, c.rollout.top_p))

  def _apply(self, upd, writer, ckpt, pbar):
    c = self.config
    t = time.perf_counter()
    results = sorted(upd.results)  # a deterministic order: float sums do not depend on arrival
    self.state, es_metrics = self.strategy.update(self.state, results)
    version = int(self.state.version)
    if version != self.ctl.version:
      raise RuntimeError(f"ES version {version} != controller version {self.ctl.version}")
    self.params[version] = self.state.params
    self._prune_params()
    acc, s = self._acc, self.runner.engine.stats
    acc["update_s"] += time.perf_counter() - t
    wall = time.perf_counter() - acc["t"]
    n = max(acc["episodes"], 1)
    record = {
        "version": version,
        "staleness_hist": es_metrics["staleness_hist"],
        "staleness_mean": es_metrics["staleness_mean"],
        "staleness_max": es_metrics["staleness_max"],
        "dropped": upd.dropped, "excluded": upd.excluded, "delayed": int(sum(upd.delayed)),
        "num_results": len(results),
        "train": {"success": acc["passed"] / n, "reward": acc["reward"] / n,
                  "episodes": acc["episodes"], "turns_per_episode": acc["turns"] / n,
                  "truncated": acc["truncated"], "failures": dict(acc["failures"])},
        "fitness": {k: _finite(es_metrics[f"fitness_{k}"]) for k in ("mean", "std", "min", "max")},
        "pairs": pair_ties(results) if c.es.antithetic else None,
        "sigma": es_metrics["sigma"], "update_norm": es_metrics["update_norm"],
        "zero_step": es_metrics["zero_step"],
        "episodes_per_s": acc["episodes"] / wall if wall > 0 else 0.0,
        "slot_utilisation": ((s.rows_busy - acc["rows_busy"]) / (s.rows_total - acc["rows_total"])
                             if s.rows_total > acc["rows_total"] else 0.0),
        "tokens_per_s": (s.tokens_decoded - acc["tokens"]) / wall if wall > 0 else 0.0,
        "time": {"generate_s": self.runner.decode_s - acc["decode_s"],
                 "env_wait_s": self.runner.wait_s - acc["wait_s"],
                 "env_worker_s": acc["env_worker_s"], "update_s": acc["update_s"], "wall_s": wall},
    }
    if c.train.eval_every and version % c.train.eval_every == 0 and version < c.train.num_updates:
      record["eval"] = self.evaluate()
    writer.write(record)
    if version % c.train.checkpoint_every == 0 or version == c.train.num_updates:
      self._save(ckpt)
    if pbar is not None:
      pbar.update(1)
      pbar.set_postfix(success=f"{record['train']['success']:.2f}",
                       stale=f"{record['staleness_mean']:.2f}", eps=f"{record['episodes_per_s']:.1f}/s")
    if self._on_update is not None:
      self._on_update(record)
    self._acc = self._new_acc()

  def _loop(self, ckpt, writer) -> dict:
    c = self.config
    t0 = time.perf_counter()
    if not self.evals and c.eval.num_tasks:
      first = self.evaluate()
      writer.write({"version": 0, "eval": first})
    if not ckpt.steps():
      self._save(ckpt)   # version 0: warm-started params, initial evaluation
    start_version = int(self.state.version)
    pbar = None
    if c.train.progress_bar:
      from tqdm import tqdm
      pbar = tqdm(total=c.train.num_updates, initial=start_version, desc="ES updates", unit="upd")
    self._acc = self._new_acc()
    try:
      while self.ctl.version < c.train.num_updates:
        self._issue_jobs()
        for r in self.runner.poll(self.params, block=True):
          self._report(r)
        while self.ctl.version < c.train.num_updates and (upd := self.ctl.pop_update()) is not None:
          self._apply(upd, writer, ckpt, pbar)
    finally:
      if pbar is not None:
        pbar.close()
    train_s = time.perf_counter() - t0
    final = None
    if c.eval.num_tasks and (not self.evals or self.evals[-1]["version"] != int(self.state.version)):
      final = self.evaluate()
      writer.write({"version": int(self.state.version), "eval": final})
      self._save(ckpt)
    ckpt.wait()
    return self._summary(train_s, start_version)

  def _summary(self, train_s: float, start_version: int) -> dict:
    c = self.config
    version = int(self.state.version)
    before = self.evals[0] if self.evals else None
    after = self.evals[-1] if self.evals else None
    summary = {"version": version, "mode": c.controller.mode, "seed": c.seed,
               "before": before, "after": after, "change": paired_change(before, after),
               "train_s_this_run": train_s,
               "updates_this_run": version - start_version,
               "updates_per_hour": 3600.0 * (version - start_version) / train_s if train_s > 0 else 0.0,
               **self.timings, "params": self.state.params}
    records = metrics.read_metrics(os.path.join(self.workdir, "metrics.jsonl"))
    if c.train.plot and records:
      metrics.plot(records, os.path.join(self.workdir, "progress.png"),
                   title=f"ES ({c.controller.mode}, {c.es.mode}) — held-out success and staleness")
    with open(os.path.join(self.workdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "params"}, f, indent=2)
    if before is not None and after is not None:
      self.log(format_table(before, after))
    return summary


def _finite(x):
  return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def pair_ties(results) -> dict:
  """Antithetic pairs of a cohort with both members' fitness, and how many of them tie: a tied
  pair adds nothing to the update (with greedy decoding, most do when σ is small)."""
  by_pair: dict[tuple[int, int], list[float]] = {}
  for version, member, fitness in results:
    by_pair.setdefault((version, keys.pair_id(member, True)), []).append(fitness)
  complete = [f for f in by_pair.values() if len(f) == 2]
  return {"complete": len(complete), "tied": sum(a == b for a, b in complete)}


def paired_change(before: dict | None, after: dict | None) -> dict | None:
  """Held-out success after minus before on the same tasks, with the standard error of the
  per-task differences (much tighter than comparing two independent ± s.e.)."""
  if not before or not after or len(before.get("per_task", [])) != len(after.get("per_task", [])):
    return None
  diff, stderr = metrics.mean_stderr(np.subtract(after["per_task"], before["per_task"]))
  return {"success": diff, "stderr": stderr, "tasks": len(after["per_task"])}


def format_table(before: dict, after: dict) -> str:
  rows = [("policy version", f"{before['version']}", f"{after['version']}"),
          ("held-out success", f"{before['success']:.3f} ± {before['stderr']:.3f}",
           f"{after['success']:.3f} ± {after['stderr']:.3f}"),
          ("held-out mean reward", f"{before['reward']:.3f}", f"{after['reward']:.3f}"),
          ("episodes", f"{before['episodes']}", f"{after['episodes']}")]
  change = paired_change(before, after)
  if change is not None:
    rows.append(("change (paired s.e.)", "", f"{change['success']:+.3f} ± {change['stderr']:.3f}"))
  width = max(len(r[0]) for r in rows)
  lines = [f"{'':{width}}  {'before ES':>16}  {'after ES':>16}"]
  lines += [f"{a:{width}}  {b:>16}  {c:>16}" for a, b, c in rows]
  return "\n".join(lines)

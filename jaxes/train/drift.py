"""How far the policy moved from where it started: drift measures at every evaluation.

Three measures, for every algorithm (ES, GRPO, ...), after the evidence that fine-tuning's cost
off-task follows its drift from the starting point (arXiv 2601.20861, 2605.30148, 2604.01499):

* ``param_drift``: ``‖θ_v − θ₀‖_F`` over every parameter, and per group of leaves
  (``param_drift_groups``: embeddings, attention, mlp, norms; a leaf in none of them counts in
  the total only);
* ``kl_to_initial``: the mean over tokens of ``KL(π_θ₀(·|prefix) ‖ π_θv(·|prefix))``, teacher-forced
  on a fixed set of held-out transcripts: the first ``eval.kl_transcripts`` episodes of version
  0's held-out evaluation (samples of π_θ₀), drawn once and written to ``kl_transcripts.json`` in
  the run directory; positions are the tokens the policy sampled, the distributions are the raw
  softmax of the logits (temperature 1), whatever temperature the episodes were sampled at;
* ``update_cosine``: the cosine between consecutive updates ``θ_v − θ_{v−1}`` and
  ``θ_{v−1} − θ_{v−2}``, in every update's metrics line (None for the first update a process
  makes without θ_{v−2} at hand: version 1, or the first after a resume).

``param_drift`` and ``kl_to_initial`` are one jitted program over the parameters where they live
(sharded or not); at version 0 both are 0. θ₀ is the run's version 0: on the devices already when
an anchor needs it every update, else read from the version-0 checkpoint (kept for good) at each
evaluation and released after it. ``update_cosine`` keeps ``θ_{v−1}`` one update longer than the
run otherwise would (often not at all: an asynchronous run keeps it for its stale jobs).
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxes.models import qwen2
from jaxes.train import checkpoint

GROUPS = {"embeddings": ("embed", "lm_head"), "attention": ("attn",), "mlp": ("mlp",),
          "norms": ("norm",)}
KL_TRANSCRIPTS = "kl_transcripts.json"


def group_of(name: str) -> str | None:
  """The group of a leaf named ``a/b/c`` (``checkpoint.leaf_names``): the first group one of
  whose markers is a part of the name, or None."""
  parts = name.lower().split("/")
  for group, markers in GROUPS.items():
    if any(m in part for part in parts for m in markers):
      return group
  return None


def _norms(initial, params) -> dict:
  names = checkpoint.leaf_names(params)
  sums = {g: jnp.float32(0) for g in GROUPS}
  total = jnp.float32(0)
  for name, p0, p in zip(names, jax.tree.leaves(initial), jax.tree.leaves(params)):
    sq = jnp.sum(jnp.square(p.astype(jnp.float32) - p0.astype(jnp.float32)))
    total = total + sq
    group = group_of(name)
    if group is not None:
      sums[group] = sums[group] + sq
  return {"param_drift": jnp.sqrt(total), "param_drift_groups": {g: jnp.sqrt(s) for g, s in sums.items()}}


def _kl(graphdef, initial, params, tokens, sampled):
  """Mean over sampled positions of KL(π_initial ‖ π_params), one transcript at a time (the
  logits of one row, ``[S, vocab]``, are the largest thing held)."""
  def row(args):
    ids, mask = args
    positions = jnp.arange(ids.shape[0])[None]
    valid = jnp.ones((1, ids.shape[0]), bool)
    lp0 = jax.nn.log_softmax(qwen2.forward(graphdef, initial, ids[None], positions, valid)[0][0, :-1]
                             .astype(jnp.float32), axis=-1)
    lpv = jax.nn.log_softmax(qwen2.forward(graphdef, params, ids[None], positions, valid)[0][0, :-1]
                             .astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(lp0) * (lp0 - lpv), axis=-1)
    return jnp.sum(jnp.where(mask[1:], kl, 0.0))

  total = jnp.sum(jax.lax.map(row, (tokens, sampled)))
  return total / jnp.maximum(jnp.sum(sampled[:, 1:]), 1).astype(jnp.float32)


@functools.lru_cache(maxsize=8)
def _measure_program(graphdef):
  def measure(initial, params, tokens, sampled):
    out = _norms(initial, params)
    if tokens is not None:
      out["kl_to_initial"] = _kl(graphdef, initial, params, tokens, sampled)
    return out
  return jax.jit(measure)


def lowering(graphdef, params, transcripts: int, length: int, replicated):
  """The measure's program lowered for θ₀ and θ placed like ``params`` (abstract arrays) and
  ``transcripts`` KL rows of ``length`` tokens (0: no KL), as the preflight sizes it: one row's
  float32 logits ``[length, vocab]`` under both policies are its largest buffers."""
  if not transcripts:
    return _measure_program(graphdef).lower(params, params, None, None)
  rows = lambda dtype: jax.ShapeDtypeStruct((transcripts, length), dtype, sharding=replicated)
  return _measure_program(graphdef).lower(params, params, rows(jnp.int32), rows(jnp.bool_))


def measure(graphdef, initial, params, transcripts: "Transcripts | None") -> dict:
  """``param_drift``, ``param_drift_groups`` and (with ``transcripts``) ``kl_to_initial`` of
  ``params`` against ``initial``, as Python floats (one jitted program)."""
  tokens, sampled = (None, None) if transcripts is None else (transcripts.tokens, transcripts.sampled)
  out = jax.tree.map(_local, _measure_program(graphdef)(initial, params, tokens, sampled))
  result = {"param_drift": float(out["param_drift"]),
            "param_drift_groups": {g: float(v) for g, v in out["param_drift_groups"].items()}}
  result["kl_to_initial"] = float(out["kl_to_initial"]) if "kl_to_initial" in out else None
  return result


@jax.jit
def _cosine(prev, before, after):
  dot = na = nb = jnp.float32(0)
  for p, b, a in zip(jax.tree.leaves(prev), jax.tree.leaves(before), jax.tree.leaves(after)):
    d1 = a.astype(jnp.float32) - b.astype(jnp.float32)
    d0 = b.astype(jnp.float32) - p.astype(jnp.float32)
    dot, na, nb = dot + jnp.sum(d1 * d0), na + jnp.sum(d1 * d1), nb + jnp.sum(d0 * d0)
  return dot / jnp.maximum(jnp.sqrt(na * nb), jnp.float32(1e-30))


def update_cosine(prev, before, after) -> float:
  """cos(after − before, before − prev) over every parameter (0 when either change is 0)."""
  return _local(_cosine(prev, before, after))


def _local(x) -> float:
  """A replicated scalar's value (this process's copy: in a multi-process run the array spans
  devices this process cannot read)."""
  return float(np.asarray(x.addressable_data(0)))


# -- the fixed transcripts of kl_to_initial ------------------------------------------------------
class Transcripts:
  """Token rows ``[N, S]`` (right-padded) and which tokens the policy sampled."""

  def __init__(self, rows: list[dict]):
    self.rows = rows
    length = max(len(r["ids"]) for r in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    sampled = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
      tokens[i, :len(r["ids"])] = r["ids"]
      sampled[i, :len(r["sampled"])] = r["sampled"]
    self.tokens, self.sampled = jnp.asarray(tokens), jnp.asarray(sampled)

  @classmethod
  def load(cls, workdir: str) -> "Transcripts | None":
    path = os.path.join(workdir, KL_TRANSCRIPTS)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      rows = json.load(f)["transcripts"]
    return cls(rows) if rows else None

  @classmethod
  def draw(cls, workdir: str, episodes: list, max_len: int) -> "Transcripts | None":
    """From version 0's held-out ``episodes`` (``rl.batch.EpisodeTokens``, task order): each
    cut to ``max_len`` tokens, written to ``kl_transcripts.json`` (atomically) and returned."""
    rows = [{"ids": e.ids[:max_len].tolist(), "sampled": e.sampled[:max_len].astype(int).tolist()}
            for e in episodes]
    tmp = os.path.join(workdir, KL_TRANSCRIPTS + ".tmp")
    with open(tmp, "w") as f:
      json.dump({"about": "held-out transcripts of version 0 (kl_to_initial is teacher-forced on "
                          "them; sampled marks the policy's tokens)", "transcripts": rows}, f)
    os.replace(tmp, os.path.join(workdir, KL_TRANSCRIPTS))
    return cls(rows) if rows else None


# -- a run's measures, as its observer takes them (observers.Drift) ---------------------------
class Meter:
  """The drift measures of one run: ``update_cosine`` around each update (``before_update``,
  ``after_update``) and ``at_evaluation``. ``initial()`` gives θ₀ where the run keeps its
  parameters; ``kl_transcripts`` episodes of version 0's evaluation are drawn (``primary``
  writes the file) and read back on a resume."""

  def __init__(self, graphdef, workdir: str, *, initial, kl_transcripts: int, max_len: int,
               im_end: int, primary: bool):
    self.graphdef, self.workdir, self.initial = graphdef, workdir, initial
    self.kl_transcripts, self.max_len, self.im_end, self.primary = kl_transcripts, max_len, im_end, primary
    self.transcripts = Transcripts.load(workdir) if kl_transcripts else None
    self._previous = None   # θ_{v-1} after the update to v
    self._before = None

  def wants_streams(self) -> bool:
    """True while the KL transcripts are still to be drawn (at version 0's evaluation)."""
    return bool(self.kl_transcripts) and self.transcripts is None

  def before_update(self, params, previous, donated: bool) -> None:
    """``params``: the current θ_v, about to be updated (copied when the update donates it);
    ``previous``: θ_{v-1} where the run still has it (None: the kept one, or none)."""
    self._before = jax.tree.map(jnp.copy, params) if donated else params
    if previous is not None:
      self._previous = previous

  def after_update(self, params) -> float | None:
    """cos(θ_{v+1} − θ_v, θ_v − θ_{v−1}) for the new ``params`` θ_{v+1} (None without θ_{v−1})."""
    cosine = None if self._previous is None else update_cosine(self._previous, self._before, params)
    self._previous, self._before = self._before, None
    return cosine

  def at_evaluation(self, version: int, params, streams: dict | None) -> dict:
    """The measures of ``params`` (version ``version``); at version 0, ``streams`` (task index ->
    EpisodeStream of that evaluation) become the KL transcripts when none are drawn yet."""
    from jaxes.rl import batch as rl_batch   # (the learner's layout of an episode's tokens)
    if streams is not None and self.wants_streams():
      episodes = [rl_batch.episode_from_stream(streams[i], self.im_end) for i in sorted(streams)
                  if streams[i].turns][:self.kl_transcripts]
      if self.primary:
        self.transcripts = Transcripts.draw(self.workdir, episodes, self.max_len)
      else:
        self.transcripts = Transcripts([{"ids": e.ids[:self.max_len].tolist(),
                                         "sampled": e.sampled[:self.max_len].tolist()} for e in episodes]
                                       ) if episodes else None
    initial = params if version == 0 else self.initial()
    return measure(self.graphdef, initial, params, self.transcripts)

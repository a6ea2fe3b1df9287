"""The GRPO learner: group-relative advantages, PPO's clipped ratio against the behaviour
policy's log-probs, optional k3 KL to a reference policy, AdamW with global-norm clipping, and
gradient accumulation over fixed-shape micro-batches under one jitted step.

    learner = GRPOLearner(graphdef, GRPOConfig(learning_rate=1e-6, micro_batches=4))
    state = learner.init(params)                 # params: an nnx.State (bf16 or f32)
    state, metrics = learner.step(state, batch)  # batch: jaxes.rl.batch.Batch

With ``master_weights`` and non-float32 params the state keeps a float32 copy that AdamW
updates (its moments are float32 too); the forward runs on the params cast from it. ``init``
copies what it is given; ``step`` donates ``state`` (so a step holds one copy of the params and
moments, not two): a caller that needs an older version's params afterwards (an engine decoding
stale episodes) keeps its own ``jax.tree.map(jnp.copy, state.params)``.

On a mesh, what only the learner reads (the master, AdamW's moments, the running gradient sums)
is also split over ``data`` (``learner_sharding``, ZeRO-2) unless ``optimizer_over_data`` is off:
the params stay where the engine decodes with them, and each update gathers them once.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxes import sharding
from jaxes.es import anchor as anchoring
from jaxes.rl import objective
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LearnerState:
  """params: what the forward uses; master: float32 copy AdamW updates, or None (then params
  are updated in place of it); ref_params: the KL reference, or None; step: updates applied."""
  params: Any
  master: Any
  opt_state: Any
  ref_params: Any
  step: jax.Array


def _is_f32(tree) -> bool:
  return all(x.dtype == jnp.float32 for x in jax.tree.leaves(tree))


def split_micro_batches(rows, k: int):
  """``rows`` (a tree of [N, ...] arrays) as k micro-batches [k, N / k, ...]. Micro-batch i takes
  rows i, i + k, ...: a batch sharded over `data` in contiguous blocks then gives every
  micro-batch rows of every data shard (each device trains its own rows)."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), rows)


class GRPOLearner:
  def __init__(self, graphdef, config: GRPOConfig):
    self.graphdef, self.config = graphdef, config
    c = config
    self.schedule = schedule = (optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps)
                                if c.warmup_steps else optax.constant_schedule(c.learning_rate))
    adamw = optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                        weight_decay=c.weight_decay)
    self.tx = optax.chain(optax.clip_by_global_norm(c.max_grad_norm), adamw) if c.max_grad_norm else adamw
    self._steps: dict = {}  # jitted step per layout of the state (see _jitted_step)
    self.loss_and_grads = jax.jit(self._loss_and_grads)

  def init(self, params, ref_params=None) -> LearnerState:
    """``ref_params``: the KL reference and the anchor's θ₀ (default: a copy of ``params``) when
    ``kl_coef`` > 0 or an anchor is on.
    With params on one mesh, every leaf is made where ``abstract_state`` places it, by one
    jitted program (so also on a mesh that spans processes)."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(params)]  # (tracers have none)
    if not (shardings and all(isinstance(sh, NamedSharding) for sh in shardings) and
            len({sh.mesh for sh in shardings}) == 1):
      return self._fresh(params, ref_params)
    target = self.abstract_state(params, jax.tree.map(lambda x: x.sharding, params))
    return jax.jit(self._fresh, out_shardings=jax.tree.map(lambda t: t.sharding, target))(
        params, ref_params)

  def _fresh(self, params, ref_params=None) -> LearnerState:
    c = self.config
    params = jax.tree.map(jnp.copy, params)
    master = None
    if c.master_weights and not _is_f32(params):
      master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    if c.kl_coef > 0 or c.anchored:   # the KL's reference and the anchor's θ₀
      ref_params = jax.tree.map(jnp.copy, params if ref_params is None else ref_params)
    else:
      ref_params = None
    opt_state = self.tx.init(params if master is None else master)
    return LearnerState(params, master, opt_state, ref_params, jnp.zeros((), jnp.int32))

  def abstract_state(self, params, shardings) -> LearnerState:
    """The state ``init`` makes from ``params`` (arrays or ``jax.ShapeDtypeStruct``s) placed by
    the parameters' ``shardings`` (``NamedSharding``s on one mesh), as ShapeDtypeStructs: params
    and the reference in their parameter's sharding; the float32 master and AdamW's moments in
    ``learner_sharding`` of it; counters replicated. What a restore targets and the preflight
    sizes."""
    shapes = jax.eval_shape(self._fresh, params)
    mesh = jax.tree.leaves(shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    learner_only = jax.tree.map(self.learner_sharding, shardings, params)

    def put(x, where=replicated):
      return sharding.abstract(x, where)

    def like(tree, sh):
      return None if tree is None else sharding.abstract(tree, sh)

    opt_state = optax.tree_map_params(self.tx, put, shapes.opt_state, learner_only,
                                      transform_non_params=put)
    return LearnerState(like(shapes.params, shardings), like(shapes.master, learner_only), opt_state,
                        like(shapes.ref_params, shardings), put(shapes.step))

  def learner_sharding(self, sharding, param) -> NamedSharding:
    """Where the learner keeps what only it reads of a parameter (float32 master, AdamW moments,
    gradient sums): with ``optimizer_over_data``, the parameter's ``sharding`` also split over
    ``data`` on its first dimension that divides evenly, unsharded dimensions first (ZeRO-2:
    every data shard holds and updates 1/data of it; the update then gathers the new params
    once). Else, or when ``data`` is 1, already used or divides no dimension: ``sharding``."""
    n = sharding.mesh.shape.get("data", 1) if isinstance(sharding, NamedSharding) else 1
    if not self.config.optimizer_over_data or n == 1:
      return sharding
    shape = param.shape
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    names = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    if any("data" in a for a in names):
      return sharding
    for i in sorted(range(len(shape)), key=lambda i: spec[i] is not None):
      split = math.prod(sharding.mesh.shape[a] for a in names[i]) * n
      if shape[i] % split == 0:
        entry = "data" if spec[i] is None else (*names[i], "data")
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[:i], entry, *spec[i + 1:]))
    return sharding

  # -- the jitted computation ------------------------------------------------------------------
  def _micro_loss(self, params, ref_params, mb):
    c = self.config
    # Activation memory is bounded by the micro-batch size and, with ``remat``, by one layer's
    # (qwen2's layer scan under jax.checkpoint; around the whole forward it saved nothing:
    # benchmarks/grpo_memory.py); the logits by ``logprob_chunk`` positions' worth. The
    # reference forward has no backward, so no remat there.
    logp = objective.sequence_logprobs(self.graphdef, params, mb["tokens"], mb["valid"],
                                       c.temperature, c.top_p, remat=c.remat, chunk=c.logprob_chunk)
    ref_logp = None
    if ref_params is not None and c.kl_coef > 0:   # (the anchor alone keeps them too)
      ref_logp = jax.lax.stop_gradient(objective.sequence_logprobs(
          self.graphdef, ref_params, mb["tokens"], mb["valid"], c.temperature, c.top_p,
          chunk=c.logprob_chunk))
    return objective.clipped_objective(
      logp, mb["behaviour_logp"], mb["advantages"], mb["weights"], clip_low=c.clip_eps_low,
      clip_high=c.clip_eps_high, ref_logp=ref_logp, kl_coef=c.kl_coef)

  def _loss_and_grads(self, params, ref_params, batch: Batch, grad_shardings=None):
    """(loss, float32 grads, metric sums) over the whole batch, one micro-batch at a time;
    the running gradient sums in ``grad_shardings`` (a tree like ``params``) when given."""
    c = self.config
    k = c.micro_batches
    if batch.num_rows % k:
      raise ValueError(f"the batch's {batch.num_rows} rows do not split into "
                       f"GRPOConfig.micro_batches={k}; pad it with build_batch(num_rows=...)")
    rows = dict(tokens=batch.tokens, valid=batch.valid, behaviour_logp=batch.behaviour_logp,
                weights=objective.token_weights(batch.sampled, c.aggregation),
                advantages=objective.group_advantages(batch.rewards, batch.group_ids,
                                                      c.advantage, c.advantage_eps))
    micro = split_micro_batches(rows, k)
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def placed(tree):  # sums split over data shards: each micro-batch's gradient reduce-scattered
      return tree if grad_shardings is None else jax.lax.with_sharding_constraint(tree, grad_shardings)

    def one(carry, mb):
      grads, loss, sums = carry
      (l, s), g = grad_fn(params, ref_params, mb)
      grads = placed(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g))
      return (grads, loss + l, jax.tree.map(jnp.add, sums, s)), None

    zeros = placed(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params))
    sums0 = dict.fromkeys(("pg_loss", "kl", "clip_fraction", "ratio"), jnp.float32(0))
    (grads, loss, sums), _ = jax.lax.scan(one, (zeros, jnp.float32(0), sums0), micro)
    return loss, grads, sums

  def _step_impl(self, state: LearnerState, batch: Batch, grad_shardings=None):
    loss, grads, sums = self._loss_and_grads(state.params, state.ref_params, batch, grad_shardings)
    metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads),
                   tokens=batch.sampled.sum(dtype=jnp.int32),
                   episodes=(batch.group_ids >= 0).sum(dtype=jnp.int32), **sums)
    return self.apply_gradients(state, grads), metrics

  def apply_gradients(self, state: LearnerState, grads) -> LearnerState:
    """The state after one optimizer step on float32 ``grads`` (a tree like the params), traced
    inside a caller's jitted step (another learner's step that shares this optimizer)."""
    target = state.params if state.master is None else state.master
    grads = jax.tree.map(lambda g, t: g.astype(t.dtype), grads, target)
    updates, opt_state = self.tx.update(grads, state.opt_state, target)
    target = optax.apply_updates(target, updates)
    if self.config.anchored:   # decoupled like AdamW's decay: the step is lr_t * anchor_decay
      step = self.schedule(state.step) * self.config.anchor_decay
      target = jax.tree.map(lambda t, r: anchoring.pull(t.astype(jnp.float32), r, self.config.anchor,
                                                        step).astype(t.dtype), target, state.ref_params)
    if state.master is None:
      params, master = target, None
    else:
      params = jax.tree.map(lambda m, p: m.astype(p.dtype), target, state.params)
      master = target
    return LearnerState(params, master, opt_state, state.ref_params, state.step + 1)

  def _jitted_step(self, state: LearnerState):
    """The step jitted so the new state keeps the given state's shardings (left to itself, XLA's
    propagation may move sharded parameters elsewhere); one compile per distinct layout."""
    leaves, treedef = jax.tree.flatten(state)
    shardings = tuple(getattr(x, "sharding", None) for x in leaves)
    key = (treedef, shardings)
    if key not in self._steps:
      out = None if None in shardings else (jax.tree.unflatten(treedef, shardings), None)
      grad_shardings = None
      if all(isinstance(getattr(x, "sharding", None), NamedSharding)
             for x in jax.tree.leaves(state.params)):
        grad_shardings = jax.tree.map(lambda x: self.learner_sharding(x.sharding, x), state.params)
      self._steps[key] = jax.jit(functools.partial(self._step_impl, grad_shardings=grad_shardings),
                                 donate_argnums=0, out_shardings=out)
    return self._steps[key]

  def lower(self, state: LearnerState, batch: Batch) -> jax.stages.Lowered:
    """The step lowered for these (possibly abstract, ``jax.ShapeDtypeStruct``) inputs: its
    ``.compile().memory_analysis()`` gives the step's device memory without running it."""
    return self._jitted_step(state).lower(state, batch)

  def step(self, state: LearnerState, batch: Batch) -> tuple[LearnerState, dict]:
    """One update on ``batch``. metrics: loss, pg_loss, kl (k3), clip_fraction and ratio (all
    under the loss's aggregation), grad_norm (before clipping), tokens (sampled tokens trained
    on), episodes. The new state has the shardings of ``state``."""
    return self._jitted_step(state)(state, batch)

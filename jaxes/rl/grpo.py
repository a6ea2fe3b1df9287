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
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

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


class GRPOLearner:
  def __init__(self, graphdef, config: GRPOConfig):
    self.graphdef, self.config = graphdef, config
    c = config
    schedule = (optax.linear_schedule(0.0, c.learning_rate, c.warmup_steps) if c.warmup_steps
                else optax.constant_schedule(c.learning_rate))
    adamw = optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                        weight_decay=c.weight_decay)
    self.tx = optax.chain(optax.clip_by_global_norm(c.max_grad_norm), adamw) if c.max_grad_norm else adamw
    self._steps: dict = {}  # jitted step per layout of the state (see _jitted_step)
    self.loss_and_grads = jax.jit(self._loss_and_grads)

  def init(self, params, ref_params=None) -> LearnerState:
    """``ref_params``: the KL reference (default: a copy of ``params``) when ``kl_coef`` > 0."""
    c = self.config
    params = jax.tree.map(jnp.copy, params)
    master = None
    if c.master_weights and not _is_f32(params):
      master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    if c.kl_coef > 0:
      ref_params = jax.tree.map(jnp.copy, params if ref_params is None else ref_params)
    else:
      ref_params = None
    opt_state = self.tx.init(params if master is None else master)
    state = LearnerState(params, master, opt_state, ref_params, jnp.zeros((), jnp.int32))
    meshes = {x.sharding.mesh for x in jax.tree.leaves(params)
              if isinstance(getattr(x, "sharding", None), NamedSharding)}  # (tracers have none)
    if len(meshes) == 1:  # counters made on the default device join the params' mesh, replicated
      replicated = NamedSharding(meshes.pop(), PartitionSpec())
      state = jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding)
                           else jax.device_put(x, replicated), state)
    return state

  # -- the jitted computation ------------------------------------------------------------------
  def _micro_loss(self, params, ref_params, mb):
    c = self.config
    # Activation memory is bounded by the micro-batch size and, with ``remat``, by one layer's
    # (qwen2's layer scan under jax.checkpoint; around the whole forward it saved nothing:
    # benchmarks/grpo_memory.py). The reference forward has no backward, so no remat there.
    logp = objective.sequence_logprobs(self.graphdef, params, mb["tokens"], mb["valid"],
                                       c.temperature, c.top_p, remat=c.remat)
    ref_logp = None
    if ref_params is not None:
      ref_logp = jax.lax.stop_gradient(objective.sequence_logprobs(
          self.graphdef, ref_params, mb["tokens"], mb["valid"], c.temperature, c.top_p))
    return objective.clipped_objective(
      logp, mb["behaviour_logp"], mb["advantages"], mb["weights"], clip_low=c.clip_eps_low,
      clip_high=c.clip_eps_high, ref_logp=ref_logp, kl_coef=c.kl_coef)

  def _loss_and_grads(self, params, ref_params, batch: Batch):
    """(loss, float32 grads, metric sums) over the whole batch, one micro-batch at a time."""
    c = self.config
    k = c.micro_batches
    if batch.num_rows % k:
      raise ValueError(f"the batch's {batch.num_rows} rows do not split into "
                       f"GRPOConfig.micro_batches={k}; pad it with build_batch(num_rows=...)")
    rows = dict(tokens=batch.tokens, valid=batch.valid, behaviour_logp=batch.behaviour_logp,
                weights=objective.token_weights(batch.sampled, c.aggregation),
                advantages=objective.group_advantages(batch.rewards, batch.group_ids,
                                                      c.advantage, c.advantage_eps))
    # Micro-batch i takes rows i, i + k, ...: a batch sharded over `data` in contiguous blocks
    # then gives every micro-batch rows of every data shard (each device trains its own rows).
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), rows)
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def one(carry, mb):
      grads, loss, sums = carry
      (l, s), g = grad_fn(params, ref_params, mb)
      grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
      return (grads, loss + l, jax.tree.map(jnp.add, sums, s)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    sums0 = dict.fromkeys(("pg_loss", "kl", "clip_fraction", "ratio"), jnp.float32(0))
    (grads, loss, sums), _ = jax.lax.scan(one, (zeros, jnp.float32(0), sums0), micro)
    return loss, grads, sums

  def _step_impl(self, state: LearnerState, batch: Batch):
    loss, grads, sums = self._loss_and_grads(state.params, state.ref_params, batch)
    target = state.params if state.master is None else state.master
    grads = jax.tree.map(lambda g, t: g.astype(t.dtype), grads, target)
    updates, opt_state = self.tx.update(grads, state.opt_state, target)
    target = optax.apply_updates(target, updates)
    if state.master is None:
      params, master = target, None
    else:
      params = jax.tree.map(lambda m, p: m.astype(p.dtype), target, state.params)
      master = target
    metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads),
                   tokens=batch.sampled.sum(dtype=jnp.int32),
                   episodes=(batch.group_ids >= 0).sum(dtype=jnp.int32), **sums)
    return LearnerState(params, master, opt_state, state.ref_params, state.step + 1), metrics

  def _jitted_step(self, state: LearnerState):
    """The step jitted so the new state keeps the given state's shardings (left to itself, XLA's
    propagation may move sharded parameters elsewhere); one compile per distinct layout."""
    leaves, treedef = jax.tree.flatten(state)
    shardings = tuple(getattr(x, "sharding", None) for x in leaves)
    key = (treedef, shardings)
    if key not in self._steps:
      out = None if None in shardings else (jax.tree.unflatten(treedef, shardings), None)
      self._steps[key] = jax.jit(self._step_impl, donate_argnums=0, out_shardings=out)
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

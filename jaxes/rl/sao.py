"""SAO's learner (Single-rollout Asynchronous Optimization, arXiv 2607.07508): one episode per
task, so the baseline is a learned value instead of a group mean, and a strict double-side
token-level clip instead of PPO's one-sided one.

    learner = SAOLearner(graphdef, GRPOConfig(...), SAOValueConfig(...), hidden_size)
    state = learner.init(params)
    state, metrics = learner.step(state, batch, train_policy=True)

The value model is a scalar head (an affine map of the policy's last hidden state / d, float32) on
the policy's own forward, read through ``stop_gradient``: the value loss trains the head only
and never moves the policy, and the head costs ``hidden_size + 1`` parameters instead of a
second model (docs/training.md, "SAO", argues the choice at 7B). Its target is the episode's
return (the reward, which comes at the end: a Monte-Carlo target, no bootstrapping); it has its
own Adam (``SAOValueConfig.learning_rate``). With ``turn_values`` every assistant turn has its
value, read at the state just before the turn's first sampled token, and each token's advantage
is ``return - V(its turn's start)``; without, the episode's first turn's value serves all.

The policy side is ``GRPOLearner``'s: its optimizer, float32 master, ZeRO-2 placement, remat and
chunked log-probs; only the loss differs (``strict_clipped_objective``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxes.rl import objective
from jaxes.rl.batch import Batch
from jaxes.rl.config import GRPOConfig, SAOValueConfig
from jaxes.rl.grpo import GRPOLearner, LearnerState, split_micro_batches


def strict_clipped_objective(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
                             weights: jax.Array, *, clip_low: float, clip_high: float
                             ) -> tuple[jax.Array, dict]:
  """SAO's surrogate, negated: ``-sum(weights * ratio * advantage)`` over the tokens whose ratio
  ``exp(logp - behaviour_logp)`` lies in ``[1 - clip_low, 1 + clip_high]``; a token outside
  contributes neither loss nor gradient, whatever its advantage's sign (PPO's min keeps the
  gradient of a token clipped on the side that would lower its objective; this does not).
  ``advantages`` [N, S] per token. Returns (loss, weighted sums: pg_loss, clip_fraction,
  clipped_low, clipped_high, ratio); weight-0 tokens count nowhere."""
  on = weights > 0
  log_ratio = jnp.where(on, logp - behaviour_logp, 0.0)
  below = on & (log_ratio < jnp.log1p(-clip_low))
  above = on & (log_ratio > jnp.log1p(clip_high))
  inside = ~(below | above)
  # The exp only of in-range log-ratios: an outside token's huge ratio never reaches the backward
  # (0 * inf would be NaN there).
  ratio = jnp.exp(jnp.where(inside, log_ratio, 0.0))
  pg = -jnp.where(inside, ratio * advantages, 0.0)
  sums = dict(pg_loss=jnp.sum(weights * pg), clip_fraction=jnp.sum(weights * (below | above)),
              clipped_low=jnp.sum(weights * below), clipped_high=jnp.sum(weights * above),
              ratio=jnp.sum(weights * jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))))
  return jnp.sum(weights * pg), sums


def value_positions(sampled: jax.Array, turn_values: bool) -> jax.Array:
  """bool [N, S]: the tokens whose preceding state carries a value: every assistant turn's first
  sampled token (``turn_values``), or each episode's first one."""
  before = jnp.pad(sampled[:, :-1], ((0, 0), (1, 0)))
  starts = sampled & ~before
  if turn_values:
    return starts
  first = jnp.cumsum(starts, axis=1) == 1
  return starts & first


def token_baselines(values_before: jax.Array, positions: jax.Array) -> jax.Array:
  """float32 [N, S]: each token's baseline, the value at the last value position at or before
  it (its turn's start); 0 before the first."""
  idx = jnp.arange(positions.shape[1], dtype=jnp.int32)
  last = jax.lax.cummax(jnp.where(positions, idx, -1), axis=1)
  picked = jnp.take_along_axis(values_before, jnp.maximum(last, 0), axis=1)
  return jnp.where(last >= 0, picked, 0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SAOLearnerState:
  """``GRPOLearner``'s state's fields (``params`` first, where a checkpoint reader finds the
  policy as in a GRPO run's), the value head ``{"w": [d], "b": []}`` (float32) and its Adam state."""
  params: Any
  master: Any
  opt_state: Any
  ref_params: Any
  step: jax.Array
  value: Any
  value_opt: Any

  @classmethod
  def of(cls, policy: LearnerState, value, value_opt) -> "SAOLearnerState":
    return cls(policy.params, policy.master, policy.opt_state, policy.ref_params, policy.step,
               value, value_opt)

  @property
  def policy(self) -> LearnerState:
    return LearnerState(self.params, self.master, self.opt_state, self.ref_params, self.step)


class SAOLearner:
  def __init__(self, graphdef, config: GRPOConfig, value: SAOValueConfig, hidden_size: int):
    if config.kl_coef:
      raise ValueError("SAOLearner: no KL term (GRPOConfig.kl_coef must be 0)")
    self.graphdef, self.config, self.value_config = graphdef, config, value
    self.hidden_size = hidden_size
    self.policy = GRPOLearner(graphdef, config)
    self.value_tx = optax.adam(value.learning_rate)
    self._steps: dict = {}

  # -- state --------------------------------------------------------------------------------------
  def _fresh_value(self):
    head = {"w": jnp.zeros((self.hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return head, self.value_tx.init(head)

  def init(self, params) -> SAOLearnerState:
    """``GRPOLearner.init``'s policy state, and a zero value head (replicated on the params'
    mesh, if any)."""
    policy = self.policy.init(params)
    head, opt = self._fresh_value()
    mesh = _mesh_of(params)
    if mesh is not None:
      head, opt = jax.device_put((head, opt), NamedSharding(mesh, PartitionSpec()))
    return SAOLearnerState.of(policy, head, opt)

  def abstract_state(self, params, shardings) -> SAOLearnerState:
    """``GRPOLearner.abstract_state`` and the value head, replicated: what a restore targets."""
    policy = self.policy.abstract_state(params, shardings)
    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, PartitionSpec())
    head, opt = jax.eval_shape(self._fresh_value)
    put = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                          sharding=replicated))
    return SAOLearnerState.of(policy, put(head), put(opt))

  # -- the jitted computation ---------------------------------------------------------------------
  def _micro_loss(self, params, head, mb):
    c, v = self.config, self.value_config
    logp, hidden = objective.sequence_logprobs_and_hidden(
        self.graphdef, params, mb["tokens"], mb["valid"], c.temperature, c.top_p, remat=c.remat,
        chunk=c.logprob_chunk)
    # The head reads the trunk, never trains it: the value loss leaves the policy as it is.
    h = jax.lax.stop_gradient(hidden).astype(jnp.float32)
    # Features scaled by 1 / d: Adam's early steps move every weight by about the learning rate,
    # so unscaled a step would move V by ~lr * d (at 7B, d = 3584) and overshoot; scaled, w and b
    # each move V by ~lr per step at any width.
    values = h @ head["w"] / self.hidden_size + head["b"]   # [n, S]: after tokens 0..t
    before = jnp.pad(values[:, :-1], ((0, 0), (1, 0)))      # the state before token t
    positions = value_positions(mb["sampled"], v.turn_values)
    returns = mb["rewards"][:, None]
    advantages = jax.lax.stop_gradient(returns - token_baselines(before, positions))
    loss, sums = strict_clipped_objective(logp, mb["behaviour_logp"], advantages, mb["weights"],
                                          clip_low=c.clip_eps_low, clip_high=c.clip_eps_high)
    value_loss = jnp.sum(mb["value_weights"] * (before - returns) ** 2)
    sums = dict(sums, value_loss=value_loss, value=jnp.sum(mb["value_weights"] * before),
                advantage=jnp.sum(mb["weights"] * advantages))
    return loss + value_loss, sums

  def _loss_and_grads(self, params, head, batch: Batch, grad_shardings=None):
    c = self.config
    k = c.micro_batches
    if batch.num_rows % k:
      raise ValueError(f"the batch's {batch.num_rows} rows do not split into "
                       f"GRPOConfig.micro_batches={k}; pad it with build_batch(num_rows=...)")
    positions = value_positions(batch.sampled, self.value_config.turn_values).astype(jnp.float32)
    rows = dict(tokens=batch.tokens, valid=batch.valid, sampled=batch.sampled,
                behaviour_logp=batch.behaviour_logp, rewards=batch.rewards,
                weights=objective.token_weights(batch.sampled, c.aggregation),
                value_weights=positions / jnp.maximum(positions.sum(), 1.0))
    grad_fn = jax.value_and_grad(self._micro_loss, argnums=(0, 1), has_aux=True)

    def placed(tree):
      return tree if grad_shardings is None else jax.lax.with_sharding_constraint(tree, grad_shardings)

    def one(carry, mb):
      grads, head_grads, loss, sums = carry
      (l, s), (g, hg) = grad_fn(params, head, mb)
      grads = placed(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g))
      return (grads, jax.tree.map(jnp.add, head_grads, hg), loss + l,
              jax.tree.map(jnp.add, sums, s)), None

    zeros = placed(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params))
    sums0 = dict.fromkeys(("pg_loss", "clip_fraction", "clipped_low", "clipped_high", "ratio",
                           "value_loss", "value", "advantage"), jnp.float32(0))
    carry = (zeros, jax.tree.map(jnp.zeros_like, head), jnp.float32(0), sums0)
    (grads, head_grads, loss, sums), _ = jax.lax.scan(one, carry, split_micro_batches(rows, k))
    return loss, grads, head_grads, sums

  def _step_impl(self, state: SAOLearnerState, batch: Batch, grad_shardings=None,
                 train_policy: bool = True):
    loss, grads, head_grads, sums = self._loss_and_grads(state.params, state.value, batch,
                                                         grad_shardings)
    updates, value_opt = self.value_tx.update(head_grads, state.value_opt, state.value)
    head = optax.apply_updates(state.value, updates)
    policy = self.policy.apply_gradients(state.policy, grads) if train_policy else state.policy
    metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads),
                   value_grad_norm=optax.tree.norm(head_grads),
                   tokens=batch.sampled.sum(dtype=jnp.int32),
                   episodes=(batch.group_ids >= 0).sum(dtype=jnp.int32), **sums)
    return SAOLearnerState.of(policy, head, value_opt), metrics

  def _jitted_step(self, state: SAOLearnerState, train_policy: bool):
    """As ``GRPOLearner``'s: the new state keeps the given state's shardings, the gradient sums
    in ``learner_sharding``; one compile per layout and per ``train_policy``."""
    leaves, treedef = jax.tree.flatten(state)
    shardings = tuple(getattr(x, "sharding", None) for x in leaves)
    key = (treedef, shardings, train_policy)
    if key not in self._steps:
      out = None if None in shardings else (jax.tree.unflatten(treedef, shardings), None)
      grad_shardings = None
      params = state.params
      if all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(params)):
        grad_shardings = jax.tree.map(lambda x: self.policy.learner_sharding(x.sharding, x), params)
      self._steps[key] = jax.jit(functools.partial(self._step_impl, grad_shardings=grad_shardings,
                                                   train_policy=train_policy),
                                 donate_argnums=0, out_shardings=out)
    return self._steps[key]

  def lower(self, state: SAOLearnerState, batch: Batch) -> jax.stages.Lowered:
    """The full step (policy and value) lowered for these (possibly abstract) inputs."""
    return self._jitted_step(state, True).lower(state, batch)

  def step(self, state: SAOLearnerState, batch: Batch, train_policy: bool = True
           ) -> tuple[SAOLearnerState, dict]:
    """One update on ``batch`` (``group_ids``: one per episode; ``rewards``: the returns); with
    ``train_policy`` False the value head alone (a value warm-up). metrics: loss, pg_loss,
    clip_fraction (clipped_low + clipped_high), ratio, advantage (all under the aggregation),
    value_loss, value (the mean value at the value positions), grad_norm, value_grad_norm,
    tokens, episodes. ``state`` is donated."""
    return self._jitted_step(state, train_policy)(state, batch)


def _mesh_of(params):
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(params)]
  if shardings and all(isinstance(s, NamedSharding) for s in shardings):
    return shardings[0].mesh
  return None

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
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from jaxes.rl import objective
from jaxes.rl.batch import Batch


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  learning_rate: float = 1e-6
  warmup_steps: int = 0            # linear warm-up from 0, then constant
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8
  max_grad_norm: float = 1.0       # 0 = no clipping
  clip_eps_low: float = 0.2        # ratio clipped to [1 - low, 1 + high] (DAPO: high 0.28)
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0             # > 0: k3 KL to the reference params given to init
  advantage: str = "zscore"        # "zscore" (GRPO) or "centered" (Dr.GRPO: no std division)
  advantage_eps: float = 1e-6
  aggregation: str = "token"       # "token" or "sequence" mean over the sampled tokens
  micro_batches: int = 1           # the batch's rows are split into this many, grads summed
  remat: bool = False              # jax.checkpoint around each micro-batch's forward
  master_weights: bool = True      # float32 master copy (and moments) when params are not f32
  temperature: float = 1.0         # of the sampling distribution the log-probs are under
  top_p: float = 1.0

  def __post_init__(self):
    def fail(key, why):
      raise ValueError(f"GRPOConfig.{key}: {why}, got {getattr(self, key)!r}")

    def number(key):
      v = getattr(self, key)
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail(key, "must be a number")
      return v

    if not number("learning_rate") > 0:
      fail("learning_rate", "must be > 0")
    for key in ("weight_decay", "max_grad_norm", "kl_coef", "adam_eps"):
      if number(key) < 0:
        fail(key, "must be >= 0")
    for key in ("adam_b1", "adam_b2"):
      if not 0 <= number(key) < 1:
        fail(key, "must be in [0, 1)")
    if not 0 < number("clip_eps_low") < 1:
      fail("clip_eps_low", "must be in (0, 1)")
    if not number("clip_eps_high") > 0:
      fail("clip_eps_high", "must be > 0")
    if not number("advantage_eps") > 0:
      fail("advantage_eps", "must be > 0")
    if not number("temperature") > 0:
      fail("temperature", "must be > 0 (GRPO needs sampled episodes; greedy has no log-probs)")
    if not 0 < number("top_p") <= 1:
      fail("top_p", "must be in (0, 1]")
    for key in ("warmup_steps", "micro_batches"):
      v = getattr(self, key)
      if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "micro_batches" else 0):
        fail(key, f"must be an int >= {1 if key == 'micro_batches' else 0}")
    if self.advantage not in objective.ADVANTAGES:
      fail("advantage", f"must be one of {objective.ADVANTAGES}")
    if self.aggregation not in objective.AGGREGATIONS:
      fail("aggregation", f"must be one of {objective.AGGREGATIONS}")
    for key in ("remat", "master_weights"):
      if not isinstance(getattr(self, key), bool):
        fail(key, "must be a bool")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "GRPOConfig":
    """From a config block (a ``ConfigDict`` or dict); an unknown key is an error naming it."""
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in d:
      if key not in known:
        raise ValueError(f"GRPOConfig.{key}: unknown key; known: {', '.join(sorted(known))}")
    return cls(**d)


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
    self._step = jax.jit(self._step_impl, donate_argnums=0)
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
    return LearnerState(params, master, opt_state, ref_params, jnp.zeros((), jnp.int32))

  # -- the jitted computation ------------------------------------------------------------------
  def _micro_loss(self, params, ref_params, mb):
    c = self.config
    logprobs = functools.partial(objective.sequence_logprobs, self.graphdef,
                                 temperature=c.temperature, top_p=c.top_p)
    forward = jax.checkpoint(logprobs) if c.remat else logprobs
    logp = forward(params, mb["tokens"], mb["valid"])
    ref_logp = None
    if ref_params is not None:
      ref_logp = jax.lax.stop_gradient(logprobs(ref_params, mb["tokens"], mb["valid"]))
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
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), rows)
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

  def step(self, state: LearnerState, batch: Batch) -> tuple[LearnerState, dict]:
    """One update on ``batch``. metrics: loss, pg_loss, kl (k3), clip_fraction and ratio (all
    under the loss's aggregation), grad_norm (before clipping), tokens (sampled tokens trained
    on), episodes."""
    return self._step(state, batch)

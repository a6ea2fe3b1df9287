"""Anchored weight decay: a pull of the parameters toward the run's starting point θ₀.

Forgetting under ES (and GRPO) fine-tuning is largely drift away from θ₀ that the task does not
need; decaying toward θ₀ instead of toward zero removes most of it at a small cost in task
reward ("Overcoming Forgetting in LLM Fine-Tuning with Evolution Strategies", arXiv 2605.30148:
λ = 10 for the L2 form, λ = 0.01 for the L1 form). With step ``t = α·λ`` (α the learning rate)
and ``θ'`` the parameters after the optimizer's step:

  l2:  θ ← θ₀ + (1 − t)(θ' − θ₀)                        computed as  θ' − t·(θ' − θ₀)
  l1:  θ ← θ₀ + sign(θ' − θ₀)·max(|θ' − θ₀| − t, 0)     computed as  θ' − clip(θ' − θ₀, −t, t)

(the L1 form is the soft-threshold, the proximal step of ``λ‖θ − θ₀‖₁``). Written as a
correction of θ' each is exactly θ' when t = 0, so λ = 0 changes no bit. Pure and jittable;
``jaxes.es.update.apply`` and the GRPO learner apply it in float32.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxes.errors import OptionError

ANCHORS = ("none", "l2", "l1")


def validate(kind: str, decay: float) -> None:
  """Raises ``OptionError`` (naming the option) for an unusable anchor setting."""
  if kind not in ANCHORS:
    raise OptionError("anchor", f"must be one of {ANCHORS}, got {kind!r}")
  if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay >= 0):
    raise OptionError("anchor_decay", f"must be a number >= 0, got {decay!r}")


def pull(stepped: jnp.ndarray, initial: jnp.ndarray, kind: str, step) -> jnp.ndarray:
  """``stepped`` (θ', float32) pulled toward ``initial`` (θ₀, any float dtype) by ``step`` = α·λ
  under ``kind`` ("l2" or "l1"; "none" returns ``stepped``)."""
  if kind == "none":
    return stepped
  offset = stepped - initial.astype(jnp.float32)
  if kind == "l2":
    return stepped - step * offset
  if kind == "l1":
    return stepped - jnp.clip(offset, -step, step)
  raise ValueError(f"anchor must be one of {ANCHORS}, got {kind!r}")

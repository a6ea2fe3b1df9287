"""Gradient-based RL baselines on the same engine, environments and metrics as ES.

  jaxes.rl.batch      episodes (engine turns or transcripts) -> fixed-shape training batches
  jaxes.rl.objective  group advantages, token weights, clipped ratio + k3 KL, teacher-forced log-probs
  jaxes.rl.config     GRPOConfig and the run config's ``grpo`` block (no JAX import)
  jaxes.rl.grpo       GRPOLearner: init(params) -> state, step(state, batch) -> (state, metrics)
"""

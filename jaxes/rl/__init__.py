"""Gradient-based RL baselines on the same engine, environments and metrics as ES (GRPO)."""
from jaxes.rl.batch import Batch, EpisodeTokens, build_batch, episode_from_messages, episode_from_turns
from jaxes.rl.grpo import GRPOConfig, GRPOLearner, LearnerState

__all__ = ["Batch", "EpisodeTokens", "GRPOConfig", "GRPOLearner", "LearnerState", "build_batch",
           "episode_from_messages", "episode_from_turns"]

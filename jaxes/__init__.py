"""jaxes: evolution strategies for post-training LLM agents, in JAX."""

__version__ = "0.1.0"

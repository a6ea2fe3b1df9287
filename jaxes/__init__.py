"""jaxes: evolution strategies for post-training LLM agents, in JAX."""
import sys as _sys

__version__ = "0.1.0"

# Every jaxes command starts quietly (jaxes.cli.start_jax): on a machine with no accelerator and
# no JAX_PLATFORMS, JAX runs on the CPU without starting the CUDA/TPU plugins that the
# [gpu-aot]/[tpu] extras install, and their import-time log lines are dropped. Done here, before
# any jaxes module imports JAX, so that commands whose modules import JAX at the top (the grid,
# compare, the checker, the report) start as quietly as the trainer. Nothing happens where JAX
# was imported already.
if "jax" not in _sys.modules:
  from jaxes import cli as _cli
  _cli.start_jax(init_backends=False)

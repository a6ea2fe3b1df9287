"""Terminal environments: tasks, the procedural generator, sandboxes, the agent protocol."""
from __future__ import annotations

import importlib

from jaxes.envs import protocol
from jaxes.envs.sandboxes.sandbox import Sandbox, SandboxError, SandboxHandle
from jaxes.envs.tasks import generator
from jaxes.envs.tasks.task import Limits, Task

# The one registry of sandbox backends: name -> "module:class", imported on first use (the docker
# backend needs the docker SDK and an engine). The config's checks and the checker's --backend
# read their choices from here; a new backend registers here and nowhere else.
SANDBOX_BACKENDS = {
    "local": "jaxes.envs.sandboxes.local_sandbox:LocalSandbox",   # root_dir, isolation, run_as_uid, use_pytest, cpus, ...
    "docker": "jaxes.envs.sandboxes.docker_sandbox:DockerSandbox",  # image, run_label, pool_size, ...
}
BACKENDS = tuple(SANDBOX_BACKENDS)


def make_sandbox(backend: str = "local", **kwargs) -> Sandbox:
  """A sandbox of the registered ``backend`` (SANDBOX_BACKENDS), built with ``kwargs``."""
  if backend not in SANDBOX_BACKENDS:
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")
  module, _, name = SANDBOX_BACKENDS[backend].partition(":")
  return getattr(importlib.import_module(module), name)(**kwargs)


__all__ = ["BACKENDS", "SANDBOX_BACKENDS", "Limits", "Sandbox", "SandboxError", "SandboxHandle", "Task", "generator",
           "make_sandbox", "protocol"]

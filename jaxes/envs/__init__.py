"""Terminal environments: tasks, the procedural generator, sandboxes, the agent protocol."""
from __future__ import annotations

from jaxes.envs import generator, protocol
from jaxes.envs.sandbox import Sandbox, SandboxError, SandboxHandle
from jaxes.envs.task import Limits, Task

BACKENDS = ("local", "docker")


def make_sandbox(backend: str = "local", **kwargs) -> Sandbox:
  """A sandbox backend: "local" (LocalSandbox: root_dir, isolation, run_as_uid, use_pytest, cpus,
  allow_weak_isolation, python) or "docker" (DockerSandbox: image, run_label, pool_size, ...)."""
  if backend == "local":
    from jaxes.envs.local_sandbox import LocalSandbox
    return LocalSandbox(**kwargs)
  if backend == "docker":
    from jaxes.envs.docker_sandbox import DockerSandbox   # needs the docker SDK and an engine
    return DockerSandbox(**kwargs)
  raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {BACKENDS}")


__all__ = ["BACKENDS", "Limits", "Sandbox", "SandboxError", "SandboxHandle", "Task", "generator",
           "make_sandbox", "protocol"]

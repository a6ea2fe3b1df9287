"""The docker backend's per-episode disk cap, side by side with no cap (issue 31).

  PYTHONPATH=. python benchmarks/docker_disk_cap.py

Runs the write that once grew the engine's disk by 1,280 MiB (five 256 MiB files into /tmp in
one 10-second command, default limits) in a container without the agent's capped tmpfs mounts
(as before issue 31; ``agent_tmpfs`` patched to none) and in one with them, and prints where the
write stopped, the container's writable layer and the host's free space during and after.
"""
import json
import shutil
from unittest import mock

import docker

from jaxes.envs.sandboxes import docker_sandbox
from jaxes.envs.tasks.task import Task

WRITE = ("for i in 1 2 3 4 5; do head -c 256M /dev/zero > /tmp/f$i || { echo stopped at $i; break; }; "
         "done; du -sm /tmp")


def main() -> None:
  client = docker.from_env()
  sandbox = docker_sandbox.DockerSandbox(client=client)
  rows = []
  try:
    for label, mounts in (("no cap", lambda *args: {}), ("capped", docker_sandbox.agent_tmpfs)):
      with mock.patch.object(docker_sandbox, "agent_tmpfs", mounts):
        free0 = shutil.disk_usage(client.info()["DockerRootDir"]).free
        with sandbox.start(Task(name="disk", instruction="x")) as handle:
          res = handle.exec(WRITE, 10)
          listed = client.api.containers(all=True, size=True, filters={"id": handle.container_id})
          free1 = shutil.disk_usage(client.info()["DockerRootDir"]).free
        free2 = shutil.disk_usage(client.info()["DockerRootDir"]).free
      rows.append({"case": label, "no_space_left": "No space left on device" in res.output,
                   "last_line": res.output.strip().splitlines()[-1],
                   "layer_mib": round(listed[0].get("SizeRw", 0) / 2**20),
                   "host_used_during_mib": round((free0 - free1) / 2**20),
                   "host_used_after_mib": round((free0 - free2) / 2**20)})
      print(rows[-1])
  finally:
    sandbox.shutdown()
  print(json.dumps(rows))


if __name__ == "__main__":
  main()

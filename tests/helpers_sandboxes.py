"""Both sandbox backends as one parametrised fixture (docker skips, with the reason, without an
engine or the sandbox image)."""
import pytest

from jaxes.envs import make_sandbox


def docker_or_skip():
  docker = pytest.importorskip("docker")
  try:
    client = docker.from_env()
    client.ping()
    client.images.get("jaxes-sandbox:latest")
  except Exception as err:
    pytest.skip(f"no docker engine or image ({err}); run `bash launch/docker/setup.sh`")


def verifier_pytest_or_skip(sandbox, task):
  """Skips, naming what to install, where the backend's verifier lacks pytest for ``task``."""
  from jaxes.envs.sandbox import SandboxError
  try:
    sandbox.check_verifier([task])
  except SandboxError as err:
    pytest.skip(str(err))


@pytest.fixture(scope="module", params=["local", "docker"])
def sandbox(request):
  if request.param == "docker":
    docker_or_skip()
  sb = make_sandbox(request.param)
  yield sb
  sb.shutdown()

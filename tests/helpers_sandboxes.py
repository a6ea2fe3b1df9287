"""Both sandbox backends as one parametrised fixture (docker carries the `docker` marker: it skips,
naming how to get one, without an engine or the sandbox image; tests/helpers_components.py)."""
import pytest

from jaxes.envs import make_sandbox


@pytest.fixture(scope="module", params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def sandbox(request):
  sb = make_sandbox(request.param)
  yield sb
  sb.shutdown()

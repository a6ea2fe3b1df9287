"""The engine's own step programs take the attention path of the platform they are built for: on
a TPU mesh (a deviceless v5p topology through libtpu) a paged engine's programs carry the Pallas
kernel ``ragged_paged_attention`` in both the ragged first step and the decode loop; on CPU the
same engine keeps the portable blockwise path."""
import pytest
from flax import nnx

from jaxes import sharding
from jaxes.models import qwen2
from jaxes.rollout.engine import Engine

KERNEL = "ragged_paged_attention_kernel"


def _step_texts(mesh=None) -> dict[str, str]:
  """The lowered text of every step program of a tiny abstract paged engine (nothing allocated;
  head_dim 128 and bfloat16, as the kernel's TPU tiling needs)."""
  cfg = qwen2.Qwen2Config.preset("tiny-gqa", dtype="bfloat16", head_dim=128)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))),
                          nnx.Param)
  engine = Engine(graphdef, cfg, num_slots=4, max_len=64, prefill_chunk=8, max_new_tokens=5,
                  stop_ids=[], im_end_id=1, mesh=mesh, abstract=True, page_size=16, num_pages=16,
                  compact=False)
  return {name: lowered.as_text() for name, lowered in engine.programs().items()
          if name.startswith("step[")}


@pytest.mark.libtpu
def test_a_paged_engine_on_a_v5p_mesh_lowers_its_steps_with_the_kernel(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock
  from jax.experimental import topologies
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  texts = _step_texts(sharding.make_mesh(data=2, tensor=2, devices=devices))
  assert texts
  for name, text in texts.items():
    # one kernel call per attention: the first step's flat buffer and the decode loop's samples
    assert text.count(KERNEL) >= 2, name


def test_a_paged_engine_on_cpu_keeps_the_portable_path():
  texts = _step_texts()
  assert texts
  for name, text in texts.items():
    assert "tpu_custom_call" not in text and KERNEL not in text, name

"""The metrics writer's TensorBoard events, read back from the event files."""
import glob
import struct
import subprocess
import sys

import pytest
from tensorboardX.proto import event_pb2

pytestmark = pytest.mark.end_to_end   # every test here launches processes


def _events(logdir) -> dict:
  """``{(tag, step): value}`` of the scalars in ``logdir``'s event files (TFRecord framing:
  length, its CRC, the serialized ``Event``, its CRC)."""
  out = {}
  for path in sorted(glob.glob(f"{logdir}/events.out.tfevents.*")):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        out[(value.tag, event.step)] = value.simple_value
  return out


def test_scalars_reach_tensorboard_and_the_writer_does_not_import_torch(tmp_path):
  """Every finite number of a record, by its path, at the record's version; a process that
  writes metrics does not pay for importing torch (tensorboardX would, for torch tensors)."""
  probe = (
      "import sys\n"
      "from jaxes.train import metrics\n"
      f"writer = metrics.MetricsWriter({str(tmp_path)!r})\n"
      "writer.write({'version': 1, 'train': {'success': 0.25, 'episodes': 8, 'ok': True}})\n"
      "writer.write({'version': 2, 'train': {'success': 0.5, 'loss': float('nan')}})\n"
      "writer.close()\n"
      "print('torch' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False", out.stderr[-2000:]
  assert _events(tmp_path / "tensorboard") == {
      ("train/success", 1): 0.25, ("train/episodes", 1): 8.0, ("train/success", 2): 0.5}

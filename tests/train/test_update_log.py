"""UpdateLog: durable appends, torn tails dropped (never applied), corruption named by offset."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest

from jaxes.controller.config import ControllerConfig
from jaxes.controller.controller import Controller
from jaxes.controller import durations
from jaxes.controller.simulate import HashFitness, Simulator
from jaxes.train import update_log
from jaxes.train.update_log import CorruptUpdateLog, UpdateLog, UpdateLogError


def _record(version: int) -> dict:
  """Deterministic content of varying size, so torn offsets land in headers and payloads alike."""
  rng = random.Random(version)
  return {"version": version, "cohort": [[version - rng.randint(0, 1), m, rng.random()]
                                         for m in range(rng.randint(1, 6))],
          "note": "x" * rng.randint(0, 40)}


def _write(path, versions):
  log = UpdateLog(str(path))
  for v in versions:
    log.append(_record(v))
  log.close()


def test_append_then_records_and_replay(tmp_path):
  path = tmp_path / "updates.log"
  _write(path, range(1, 6))
  log = UpdateLog(str(path))
  assert log.records() == [_record(v) for v in range(1, 6)]
  assert log.replay_after(3) == [_record(4), _record(5)]
  assert log.replay_after(5) == [] and log.replay_after(0) == log.records()
  log.append(_record(6))   # appending continues a reopened log
  assert [r["version"] for r in log.records()] == list(range(1, 7))
  log.close()
  assert UpdateLog(str(tmp_path / "absent.log")).records() == []


def test_every_truncation_offset_gives_exactly_the_complete_records(tmp_path):
  path = tmp_path / "updates.log"
  _write(path, range(1, 6))
  data = path.read_bytes()
  ends = [len(b"".join(update_log.encode(_record(v)) for v in range(1, k + 1))) for k in range(6)]
  assert ends[-1] == len(data)
  cut = tmp_path / "cut.log"
  for offset in range(len(data) + 1):
    cut.write_bytes(data[:offset])
    complete = max(k for k in range(6) if ends[k] <= offset)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      got = UpdateLog(str(cut)).records()
    assert got == [_record(v) for v in range(1, complete + 1)], offset
    torn = [w for w in caught if "torn" in str(w.message)]
    assert bool(torn) == (offset not in ends), offset


def test_zero_filled_tail_is_torn_too(tmp_path):
  path = tmp_path / "updates.log"
  _write(path, range(1, 4))
  with open(path, "ab") as f:
    f.write(b"\0" * 100)
  with pytest.warns(RuntimeWarning, match="zero bytes"):
    assert [r["version"] for r in UpdateLog(str(path)).records()] == [1, 2, 3]


def test_torn_tail_is_kept_aside_and_the_next_append_follows_the_valid_prefix(tmp_path):
  path = tmp_path / "updates.log"
  _write(path, range(1, 4))
  valid = path.stat().st_size
  half = update_log.encode(_record(4))[:20]
  with open(path, "ab") as f:
    f.write(half)
  log = UpdateLog(str(path))
  with pytest.warns(RuntimeWarning, match="never applied"):
    log.append(_record(4))   # the torn version 4 was never acknowledged: written again
  log.close()
  assert UpdateLog(str(path)).records() == [_record(v) for v in range(1, 5)]
  assert (tmp_path / f"updates.log.torn.{valid}").read_bytes() == half


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_record_in_the_middle_is_an_error_naming_its_offset(tmp_path, where):
  path = tmp_path / "updates.log"
  _write(path, range(1, 5))
  offset = len(update_log.encode(_record(1)))   # record 2 starts here
  data = bytearray(path.read_bytes())
  data[offset + (20 if where == "payload" else 5)] ^= 0x01
  path.write_bytes(bytes(data))
  log = UpdateLog(str(path))
  with pytest.raises(CorruptUpdateLog, match=f"byte offset {offset}: .*move the log aside") as e:
    log.records()
  assert e.value.offset == offset
  with pytest.raises(CorruptUpdateLog):
    log.append(_record(5))   # nothing is appended after corruption
  assert bytes(data) == path.read_bytes()


def test_versions_must_increase_and_replay_must_be_contiguous(tmp_path):
  log = UpdateLog(str(tmp_path / "updates.log"))
  log.append(_record(1))
  with pytest.raises(UpdateLogError, match="version 1 after 1"):
    log.append(_record(1))
  with pytest.raises(UpdateLogError, match="int 'version'"):
    log.append({"cohort": []})
  log.append(_record(3))   # a later run may log from a newer checkpoint on ...
  with pytest.raises(UpdateLogError, match="next record is version 3, expected 2"):
    log.replay_after(1)    # ... but replaying across the gap is refused
  assert log.replay_after(2) == [_record(3)]
  log.close()


def test_truncate_to_sets_later_records_aside(tmp_path):
  path = tmp_path / "updates.log"
  _write(path, range(1, 7))
  log = UpdateLog(str(path))
  dropped = log.truncate_to(3)
  assert dropped == [_record(v) for v in (4, 5, 6)]
  assert log.records() == [_record(v) for v in (1, 2, 3)]
  log.append(_record(4) | {"note": "the new timeline"})
  assert log.records()[-1]["note"] == "the new timeline"
  log.close()
  superseded = (tmp_path / "updates.log.superseded").read_bytes()
  assert update_log.scan(superseded)[0] == dropped
  assert UpdateLog(str(path)).truncate_to(10) == []


_WRITER = textwrap.dedent("""
  import importlib.util, os, random, signal, sys
  # Load the module by path: this process needs nothing else from the package.
  spec = importlib.util.spec_from_file_location("update_log", sys.argv[1])
  update_log = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(update_log)
  path, mode, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])

  def record(v):
    rng = random.Random(v)   # some records large, so a kill can land inside a write
    return {"version": v, "payload": "%d" % v * rng.choice([1, 10, 100, 50000])}

  log = update_log.UpdateLog(path)
  done = log.records()
  v = done[-1]["version"] + 1 if done else 1
  if mode == "half":   # die with half a frame written, as a kill inside write() would leave it
    log.append(record(v))
    frame = update_log.encode(record(v + 1))
    with open(path, "ab") as f:
      f.write(frame[:len(frame) // 2])
      f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
  while True:
    log.append(record(v))
    print(v, flush=True)   # acknowledged: durable from here on
    v += 1
""")


def _expected(v):
  rng = random.Random(v)
  return {"version": v, "payload": "%d" % v * rng.choice([1, 10, 100, 50000])}


@pytest.mark.end_to_end
def test_sigkill_at_random_moments_leaves_exactly_a_valid_prefix(tmp_path):
  path = str(tmp_path / "updates.log")
  script = tmp_path / "writer.py"
  script.write_text(_WRITER)
  rng = random.Random(0)
  acked = 0
  for round_ in range(8):
    mode = "half" if round_ % 4 == 3 else "loop"
    proc = subprocess.Popen([sys.executable, str(script), update_log.__file__, path, mode, str(round_)],
                            stdout=subprocess.PIPE, text=True)
    if mode == "loop":
      for _ in range(rng.randint(1, 30)):   # wait for a random number of acknowledged appends
        acked = int(proc.stdout.readline())
      os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")   # a torn tail is expected here
      records = UpdateLog(path).records()
    versions = [r["version"] for r in records]
    assert versions == list(range(1, len(versions) + 1))
    assert records == [_expected(v) for v in versions]   # never a partial record
    assert versions[-1] >= acked   # every acknowledged append survived
    acked = versions[-1]


def _realistic_records(updates: int) -> list[dict]:
  """What a run logs per update at population 30 x 8 episodes (async, staleness bound 1): the
  cohort's (version, member, fitness) with staleness tags, the controller state after the update
  and the ES metrics line — driven by the real controller in the discrete-event simulator."""
  config = ControllerConfig(mode="async", population=30, episodes_per_member=8, max_staleness=1, seed=0)
  records = []

  class Logged(HashFitness):
    def apply(self, update, live_versions):
      fitness = [f for _, _, f in update.results]
      records.append({
          "version": update.version + 1, "cohort": [list(r) for r in update.results],
          "staleness": update.staleness, "delayed": update.delayed, "dropped": update.dropped,
          "excluded": update.excluded, "controller": sim.ctl.state_dict(),
          "metrics": {"num_results": len(fitness), "fitness_mean": sum(fitness) / max(1, len(fitness)),
                      "fitness_max": max(fitness, default=0.0), "staleness_hist": [0, 0],
                      "sigma": 0.015, "update_norm": 1.234567, "live_versions": live_versions}})
      return {}

  sim = Simulator(Controller(config, num_tasks=512), workers=64,
                  durations=durations.parse("lognormal:1.0", 60.0, 0), fitness=Logged())
  sim.run(updates)
  return records


def test_realistic_records_round_trip_and_stay_small(tmp_path):
  records = _realistic_records(12)
  path = tmp_path / "updates.log"
  log = UpdateLog(str(path))
  for r in records:
    log.append(r)
  log.close()
  assert json.loads(json.dumps(UpdateLog(str(path)).records())) == json.loads(json.dumps(records))
  sizes = [len(update_log.encode(r)) for r in records]
  assert all(len(r["cohort"]) == 30 for r in records)
  assert max(sizes) < 256 * 1024   # kilobytes per update, against gigabytes for a full 7B checkpoint

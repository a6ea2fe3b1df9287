"""Hooks: ``every``-th update, after the last one with ``at_final``, never with ``every=0``; due
hooks run in order on one shared ``UpdateInfo``."""
from jaxes.train.hooks import Hook, UpdateInfo, run_hooks


def _info(version: int, final: bool = False) -> UpdateInfo:
  return UpdateInfo(version=version, record={"version": version}, final=final)


def _noop(info):
  pass


def test_due_every_kth_version():
  hook = Hook(_noop, every=3)
  assert [v for v in range(1, 10) if hook.due(_info(v))] == [3, 6, 9]


def test_every_zero_is_never_but_at_final_still_runs_after_the_last():
  never = Hook(_noop, every=0)
  final_only = Hook(_noop, every=0, at_final=True)
  assert not any(never.due(_info(v, final=v == 5)) for v in range(1, 6))
  assert [v for v in range(1, 6) if final_only.due(_info(v, final=v == 5))] == [5]


def test_at_final_adds_the_last_update_off_the_period():
  hook = Hook(_noop, every=4, at_final=True)
  assert [v for v in range(1, 8) if hook.due(_info(v, final=v == 7))] == [4, 7]
  # without at_final the last update runs only on the period
  assert not Hook(_noop, every=4).due(_info(7, final=True))


def test_run_hooks_calls_due_hooks_in_order_and_a_later_one_sees_an_earlier_ones_record():
  calls = []

  def evaluate(info):
    calls.append(("eval", info.version))
    info.record["eval"] = 0.5

  def write(info):
    calls.append(("write", info.version, dict(info.record)))

  hooks = [Hook(evaluate, every=2), Hook(write), Hook(lambda info: calls.append("never"), every=0)]
  for version in (1, 2):
    run_hooks(hooks, _info(version))
  assert calls == [("write", 1, {"version": 1}),
                   ("eval", 2), ("write", 2, {"version": 2, "eval": 0.5})]


def test_update_info_results_default_to_a_fresh_list():
  a, b = _info(1), _info(2)
  a.results.append((0, 0, 1.0))
  assert b.results == []

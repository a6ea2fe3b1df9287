"""Where the suite's time goes: per test, the seconds XLA spent compiling (tracing to a jaxpr,
lowering to StableHLO, the backend's compile: each also on its own, since a persistent-cache hit
skips only the last), the seconds it spent reading programs back from the persistent compilation
cache, the cache's hits and misses, and the test's wall time.

Read from ``jax.monitoring``'s duration events inside each pytest process (the xdist workers
each write their own part; the controller merges them). Programs compiled by processes that a
test launches (the multi-process and kill-and-resume tests) are not seen here: they count as
that test's run time. The merged table is written to ``build/test-timings.json`` (or
``$JAXES_TEST_TIMINGS``) and its top rows are printed at the end of the run.
"""
import collections
import json
import os
import pathlib
import time

import pytest

COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                  "/jax/core/compile/backend_compile_duration": "backend_s"}
CACHE_READ_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"
CACHE_HIT_EVENT, CACHE_MISS_EVENT = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class _Totals:
  """Running sums of the monitoring events in this process."""

  def __init__(self):
    self.cache_read_s = 0.0
    self.phases = dict.fromkeys(COMPILE_EVENTS.values(), 0.0)
    self.hits = self.misses = 0

  def on_duration(self, event, duration, **_):
    if event in COMPILE_EVENTS:
      self.phases[COMPILE_EVENTS[event]] += duration
    elif event == CACHE_READ_EVENT:
      self.cache_read_s += duration

  def on_event(self, event, **_):
    if event == CACHE_HIT_EVENT:
      self.hits += 1
    elif event == CACHE_MISS_EVENT:
      self.misses += 1

  def snapshot(self) -> dict:
    return dict(self.phases, compile_s=sum(self.phases.values()), cache_read_s=self.cache_read_s,
                cache_hits=self.hits, cache_misses=self.misses)


_totals = _Totals()
_rows: dict[str, dict] = {}


def _output_path(config) -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXES_TEST_TIMINGS", config.rootpath / "build" / "test-timings.json"))


def _worker_id(config) -> str | None:
  return getattr(config, "workerinput", {}).get("workerid")


def pytest_configure(config):
  from jax import monitoring   # imported here: conftest sets the JAX environment first
  monitoring.register_event_duration_secs_listener(_totals.on_duration)
  monitoring.register_event_listener(_totals.on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Set-up, call and tear-down together: module fixtures' compiles count toward the test that
  first needed them."""
  before, start = _totals.snapshot(), time.perf_counter()
  yield
  after = _totals.snapshot()
  _rows[item.nodeid] = {"wall_s": round(time.perf_counter() - start, 3),
                        **{k: round(after[k] - before[k], 3) for k in after}}


def pytest_sessionfinish(session):
  worker = _worker_id(session.config)
  path = _output_path(session.config)
  path.parent.mkdir(parents=True, exist_ok=True)
  if worker is not None:   # a part for the controller to merge
    path.with_name(f"{path.stem}.{worker}.json").write_text(json.dumps(_rows))
    return
  rows = dict(_rows)
  for part in path.parent.glob(f"{path.stem}.*.json"):
    rows.update(json.loads(part.read_text()))
    part.unlink()
  if rows:
    path.write_text(json.dumps(rows, indent=1, sort_keys=True))


def pytest_terminal_summary(terminalreporter, config):
  if _worker_id(config) is not None:
    return
  path = _output_path(config)
  if not path.exists():
    return
  rows = json.loads(path.read_text())
  by_file = collections.defaultdict(lambda: collections.Counter())
  for nodeid, row in rows.items():
    by_file[nodeid.split("::")[0]].update({k: v for k, v in row.items()})
  total = collections.Counter()
  for row in by_file.values():
    total.update(row)
  write = terminalreporter.write_line
  write(f"\nXLA compile share (this suite's pytest processes; launched processes count as run "
        f"time): {total['compile_s']:.0f} s compiling (tracing {total['trace_s']:.0f}, lowering "
        f"{total['lower_s']:.0f}, backend {total['backend_s']:.0f}) + {total['cache_read_s']:.0f} s cache reads "
        f"of {total['wall_s']:.0f} s test wall time; cache hits {total['cache_hits']}, misses "
        f"{total['cache_misses']}. Per test: {path}")
  write(f"{'file':<44} {'wall s':>8} {'compile s':>10} {'cache s':>8} {'hits':>6} {'misses':>7}")
  for name, row in sorted(by_file.items(), key=lambda kv: -kv[1]["wall_s"])[:15]:
    write(f"{name:<44} {row['wall_s']:>8.1f} {row['compile_s']:>10.1f} {row['cache_read_s']:>8.1f} "
          f"{row['cache_hits']:>6} {row['cache_misses']:>7}")

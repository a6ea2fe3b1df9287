r"""``python -m jaxes.experiments.grid``: the paper's experiment grid as one command.

  python -m jaxes.experiments.grid --config=configs/demo_grid.py \
      --variants=sync,async1,delay4,delay8,allstale,grpo --seeds=0,1,2 --workdir=runs/grid \
      [--config.KEY=VALUE ...] [--parallel=N | --print-launch [--launcher=local|tpu|slurm]] \
      [--surface="delay_fraction=0.1,0.5 delay_updates=4,8" [--surface_base=async1]] [--aggregate-only]

Every (variant, seed) is its own run in ``WORKDIR/<variant>-s<seed>``, trained by
``python -m ENTRY --config=FILE:VARIANT --workdir=... --config.seed=S`` (the variant's overrides,
then the user's). Rerunning the command skips finished runs (summary.json at the final version)
and reruns the others, which resume from their newest checkpoint. With a supervised warm start
in the config (configs/demo_grid.py), each seed's warm start is made once, in
``WORKDIR/init-s<seed>``, and that seed's variants start from it (``warmstart.init_from``), as
every variant of the paper starts from one Instruct checkpoint. Then every run is read into
``WORKDIR/table.md``, ``table.json``, ``success.png`` (``reward.png`` on WebShop, whose score is
the mean reward), ``staleness.png`` and ``report.html`` (curves side by side, the paper's
numbers beside them); missing, failed and unfinished runs and unavailable
variants are rows saying so. ``--aggregate-only`` only reads the runs (and rewrites the table,
plots and report), and a variant with no run directory there is an error, not an empty row. A
grid directory whose ``grid.json`` records another config or other overrides is refused unless
``--overwrite``.

``--surface`` adds one variant per cell of a grid of config values (``jaxes.experiments.surface``:
any key may be an axis; a cell is ``--surface_base``'s variant plus the cell's values, named
``delay_fraction=0.1+delay_updates=8``; ``;`` joins products, for a subset) beside the
``--variants`` (then ``sync,async1`` by default, the references); the table and report then hold the surface's paired differences, the
fitted staleness slope and a heat map (``jaxes.experiments.stats``).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from jaxes import cli

if __name__ == "__main__":   # a command: JAX starts quietly (cli.start_jax) before an import below loads it
  cli.start_jax(init_backends=False)

from jaxes.experiments import aggregate, rundirs, stats, surface as surface_lib, variants as variants_lib
from jaxes.experiments.variants import GridError, Variant

DEFAULT_VARIANTS = "sync,async1,delay4,delay8,allstale"
SURFACE_REFERENCES = "sync,async1"   # the default --variants beside a --surface
LAUNCHERS = ("local", "tpu", "slurm")


# -- the plan -------------------------------------------------------------------------------------
def resolve_config(spec: str, overrides: list[str]):
  """The config ``python -m jaxes.train --config=SPEC OVERRIDES`` would see (same parser)."""
  from absl import flags
  from ml_collections import config_flags
  argv = ["grid", f"--config={spec}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
  try:
    values(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    text = str(e)
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":   # KeyError quotes its text
      text = text[1:-1].replace("\\n", "\n")
    if isinstance(e, (AttributeError, KeyError)):   # an override names a key the config lacks
      missing = (re.findall(r"\w+", text.split("Did you mean")[0]) or [""])[0]
      hint = re.search(r'Did you mean "(\w+)"', text)
      for key in (a[2:].split("=", 1)[0] for a in overrides):
        if missing in key.split(".")[1:]:
          raise GridError(f"{key}: unknown key" + (f" (did you mean {hint.group(1)!r}?)" if hint else "")) from None
    last = [line.strip() for line in text.splitlines() if line.strip()]
    raise GridError(f"--config={spec}: {last[-1] if last else type(e).__name__}") from None
  return values.config


class Run:
  """One trainer invocation of the grid (a variant's seed, or a seed's shared warm start)."""

  def __init__(self, name: str, workdir: str, command: list[str], num_updates: int,
               variant: str, seed: int, needs: str | None = None):
    self.name, self.workdir, self.command = name, workdir, command
    self.num_updates, self.variant, self.seed, self.needs = num_updates, variant, seed, needs
    self.proc: subprocess.Popen | None = None
    self.started = 0.0

  @property
  def finished(self) -> bool:
    return rundirs.is_finished(self.workdir, self.num_updates)


def surface_variants(config: str, spec: str, base_name: str, overrides: list[str], module=None) -> list[Variant]:
  """The cells of ``--surface=SPEC`` as variants on ``base_name`` (keys resolved in its config)."""
  base = variants_lib.resolve(config, base_name, module)
  if not base.available:
    raise GridError(f"--surface_base={base_name}: {base.unavailable}")
  resolved = resolve_config(base.config_spec, base.override_flags() + list(overrides))
  return surface_lib.variants(surface_lib.cells_of(spec, resolved), base)


def plan(config: str, variant_names: list[str], seeds: list[int], workdir: str,
         overrides: list[str], shared_init: bool | None = None, surface: str = "",
         surface_base: str = "async1"):
  """(variants, init runs, variant runs): every command the grid would run."""
  path = config.partition(":")[0]
  module = variants_lib.load_module(path)
  variants = [variants_lib.resolve(config, n, module) for n in variant_names]
  if surface:
    variants += surface_variants(config, surface, surface_base, overrides, module)
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
      raise GridError(f"--surface: a cell repeats a variant ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
  inits, runs = {}, []
  for seed in seeds:
    for v in variants:
      if not v.available:
        continue
      flags_ = v.override_flags() + list(overrides) + [f"--config.seed={seed}"]
      c = resolve_config(v.config_spec, flags_)
      share = (c.warmstart.steps > 0 and not c.warmstart.init_from) if shared_init is None else shared_init
      if share and seed not in inits:   # the first variant's config makes the seed's warm start
        init_dir = os.path.join(workdir, f"init-s{seed}")
        # The warm start alone: no updates, no evaluation, so no task shift (env.shift_at_update
        # must fall within a run's updates).
        init_flags = flags_ + ["--config.train.num_updates=0", "--config.eval.num_tasks=0",
                               "--config.env.shift_families=", "--config.env.shift_at_update=0"]
        resolve_config(v.config_spec, init_flags)
        inits[seed] = Run(f"init-s{seed}", init_dir, _command(v, init_dir, init_flags), 0, "init", seed)
      if share:
        flags_.append(f"--config.warmstart.init_from={inits[seed].workdir}")
      run_dir = os.path.join(workdir, rundirs.run_name(v.name, seed))
      runs.append(Run(rundirs.run_name(v.name, seed), run_dir, _command(v, run_dir, flags_),
                      int(c.train.num_updates), v.name, seed, needs=inits[seed].name if share else None))
  return variants, list(inits.values()), runs


def seed_major(inits: list[Run], runs: list[Run]) -> list[Run]:
  """Each seed's warm start, then that seed's runs: a grid stopped early holds whole seeds
  (every variant paired with sync) rather than every warm start and few runs."""
  by_seed = {r.seed: [r] for r in inits}
  for r in runs:
    by_seed.setdefault(r.seed, []).append(r)
  return [r for seed_runs in by_seed.values() for r in seed_runs]


def _command(v: Variant, workdir: str, flags_: list[str]) -> list[str]:
  return ["python", "-m", v.entry, f"--config={v.config_spec}", f"--workdir={workdir}", *flags_]


def launch_line(run: Run, launcher: str, launcher_args: list[str]) -> str:
  """One shell line that runs ``run`` with a launch/ script."""
  name = "jaxes-" + run.name.lower().replace("_", "-")
  if launcher == "tpu":
    return shlex.join(["launch/tpu/run.sh", "--name", name, *launcher_args, "up", "--", *run.command])
  if launcher == "slurm":
    return shlex.join(["launch/gpu/slurm.sh", "--job-name", name, *launcher_args, "--", *run.command])
  return shlex.join(run.command)


# -- running locally ------------------------------------------------------------------------------
def _die_with_parent():
  """In the child: SIGKILL when the grid dies (even by SIGKILL), so no run trains unwatched."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
  except OSError:
    pass


def _version(run: Run) -> int:
  from jaxes.train import metrics
  return sum("train" in r for r in metrics.read_metrics(os.path.join(run.workdir, "metrics.jsonl")))


class LocalRunner:
  """Runs the grid's runs ``parallel`` at a time, a run only after the one it needs finished."""

  def __init__(self, parallel: int, log=None):
    self.parallel, self.log = parallel, log or (lambda s: print(s, file=sys.stderr, flush=True))
    self.running: list[Run] = []

  def _start(self, run: Run) -> None:
    os.makedirs(run.workdir, exist_ok=True)
    command = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(run.command)]
    run.started = time.time()
    rundirs.start_attempt(run.workdir, run.command, run.started)
    with open(os.path.join(run.workdir, rundirs.GRID_LOG), "ab") as out:
      out.write(f"\n=== grid: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {shlex.join(run.command)}\n".encode())
      out.flush()
      run.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, preexec_fn=_die_with_parent)
    self.running.append(run)
    self.log(f"grid: started {run.name} (pid {run.proc.pid})")

  def _not_started(self, run: Run, why: str) -> None:
    """Recorded as a failed attempt, so the table says why the run is absent."""
    os.makedirs(run.workdir, exist_ok=True)
    with open(os.path.join(run.workdir, rundirs.GRID_LOG), "a") as out:
      out.write(why + "\n")
    rundirs.start_attempt(run.workdir, run.command, time.time())
    rundirs.finish_attempt(run.workdir, 1, 0.0, 0.0)
    self.log(f"grid: {run.name} {why[len('error: '):]}")

  def _reap(self) -> list[Run]:
    done = []
    for run in list(self.running):
      pid, status, usage = os.wait4(run.proc.pid, os.WNOHANG)
      if pid == 0:
        continue
      run.proc.returncode = os.waitstatus_to_exitcode(status)
      wall = time.time() - run.started
      rundirs.finish_attempt(run.workdir, run.proc.returncode, wall, usage.ru_utime + usage.ru_stime)
      self.running.remove(run)
      done.append(run)
      ok = run.proc.returncode == 0 and run.finished
      self.log(f"grid: {run.name} {'finished' if ok else 'FAILED'} (exit {run.proc.returncode}, "
               f"{wall / 60:.1f} min, {usage.ru_utime + usage.ru_stime:.0f} CPU s)"
               + ("" if ok else f": {rundirs.last_error(run.workdir)}"))
    return done

  def stop(self) -> None:
    """SIGTERM every running run's process group, SIGKILL after 10 s; they resume on a rerun."""
    for run in self.running:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGTERM)
    deadline = time.time() + 10
    while self.running and time.time() < deadline:
      self._reap()
      time.sleep(0.2)
    for run in self.running:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)
    while self.running:
      self._reap()
      time.sleep(0.1)

  def run_all(self, runs: list[Run]) -> None:
    todo = [r for r in runs if not r.finished]
    for r in runs:
      if r.finished:
        self.log(f"grid: {r.name} already finished (version {r.num_updates}), skipped")
    by_name = {r.name: r for r in runs}
    failed: set[str] = set()
    total, t0, last_line, last_t = len(todo), time.time(), "", 0.0
    while todo or self.running:
      for run in self._reap():
        if not (run.proc.returncode == 0 and run.finished):
          failed.add(run.name)
      for run in list(todo):
        if len(self.running) >= self.parallel:
          break
        need = by_name.get(run.needs) if run.needs else None
        if need is not None and need.name in failed:
          todo.remove(run)
          failed.add(run.name)
          self._not_started(run, f"error: not started: {need.name} failed (see {need.workdir}/{rundirs.GRID_LOG})")
        elif need is None or need.finished:
          todo.remove(run)
          self._start(run)
      line = (f"grid: {total - len(todo) - len(self.running) - len(failed)}/{total} done, "
              f"{len(failed)} failed, {len(todo)} queued, running "
              + (", ".join(f"{r.name} v{_version(r)}/{r.num_updates}" for r in self.running) or "none"))
      if line != last_line and time.time() - last_t >= 10:
        self.log(f"{line} [{(time.time() - t0) / 60:.1f} min]")
        last_line, last_t = line, time.time()
      time.sleep(0.5)


def _interrupt(signum, frame):
  """SIGTERM stops the grid as Ctrl-C does."""
  raise KeyboardInterrupt


# -- the command line -----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxes.experiments.grid", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True,
                 help="config file (FILE, or FILE:{variant},ARGS for configs taking more arguments)")
  p.add_argument("--variants", default=None,
                 help=f"comma-separated variant names (default {DEFAULT_VARIANTS}; {SURFACE_REFERENCES} with --surface)")
  p.add_argument("--surface", default="",
                 help="axes of config values, 'KEY=V1,V2 KEY2=...': one variant per combination")
  p.add_argument("--surface_base", default="async1", help="the variant each surface cell modifies")
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (config.seed)")
  p.add_argument("--workdir", required=True, help="grid directory: one run directory per (variant, seed)")
  p.add_argument("--parallel", type=int, default=1, help="runs at once (local)")
  p.add_argument("--print-launch", "--print_launch", action="store_true", dest="print_launch",
                 help="print one launch command per run instead of running")
  p.add_argument("--launcher", choices=LAUNCHERS, default="local",
                 help="with --print-launch: plain commands, launch/tpu/run.sh or launch/gpu/slurm.sh")
  p.add_argument("--launcher_args", default="", help="flags for the launch script, e.g. '--zone us-east5-a'")
  p.add_argument("--aggregate-only", "--aggregate_only", action="store_true", dest="aggregate_only",
                 help="only read the existing runs into the table and plots")
  p.add_argument("--overwrite", action="store_true",
                 help="run in a grid directory that grid.json says holds another grid")
  p.add_argument("--target_se", type=float, default=stats.TARGET_SE,
                 help="points: the table recommends the seeds for this s.e. of a paired difference")
  share = p.add_mutually_exclusive_group()
  share.add_argument("--shared_init", dest="shared_init", action="store_true", default=None,
                     help="one warm start per seed for all variants (default: when the config has one)")
  share.add_argument("--no_shared_init", dest="shared_init", action="store_false")
  return p


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  own, overrides = [], []
  for a in argv:
    if a.startswith("--config."):
      if "=" not in a:
        raise GridError(f"{a}: write overrides as --config.KEY=VALUE")
      overrides.append(a)
    else:
      own.append(a)
  return own, overrides


def _csv(text: str, what: str, cast=str) -> list:
  items = [x.strip() for x in text.split(",") if x.strip()]
  try:
    items = [cast(x) for x in items]
  except ValueError:
    raise GridError(f"--{what}={text}: expected comma-separated {cast.__name__}s") from None
  if not items or len(set(items)) != len(items):
    raise GridError(f"--{what}={text}: needs one or more distinct values")
  return items


def check_workdir(args, names: list[str], seeds: list[int], overrides: list[str]) -> None:
  """GridError where the command would overwrite another grid's record or aggregate runs that
  are not there (a misspelt variant would make an empty table over the real one)."""
  if args.aggregate_only:
    missing = [n for n in names if not any(
        os.path.isdir(os.path.join(args.workdir, rundirs.run_name(n, s))) for s in seeds)]
    if missing:
      present = sorted(d for d in os.listdir(args.workdir) if re.fullmatch(r".+-s\d+", d)) \
          if os.path.isdir(args.workdir) else []
      raise GridError(f"--aggregate-only: no runs of variant(s) {', '.join(missing)} for seeds "
                      f"{seeds} in {args.workdir} (run directories there: {', '.join(present) or 'none'});"
                      f" nothing was written")
    return
  try:
    with open(os.path.join(args.workdir, "grid.json")) as f:
      recorded = json.load(f)
  except (OSError, ValueError):
    return
  if args.overwrite:
    return
  for key, mine in (("config", args.config), ("overrides", overrides)):
    if recorded.get(key) != mine:
      raise GridError(f"{args.workdir} holds another grid ({key} {recorded.get(key)!r} in its grid.json, "
                      f"{mine!r} here); use another --workdir, or --overwrite")


def write_results(variants, runs, seeds, workdir, target_se: float = stats.TARGET_SE) -> dict:
  from jaxes.experiments import plots
  result = aggregate.aggregate(variants, seeds, workdir, {(r.variant, r.seed): r.num_updates for r in runs})
  if any(v["variant"] == aggregate.REFERENCE for v in result["variants"]):
    result["paired"] = stats.surface_summary(stats.grid_rows(result), seeds, target_se)
  md, _ = aggregate.write(result, workdir)
  pictures = plots.write(result, workdir)
  page = plots.write_grid_report(result, workdir)
  print(open(md).read())
  print(f"grid: table in {md} and table.json; plots {', '.join(map(os.path.basename, pictures))} "
        f"in {workdir}; report {page}", file=sys.stderr)
  return result


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    own, overrides = _split_overrides(argv)
    args = _parser().parse_args(own)
    default = SURFACE_REFERENCES if args.surface else DEFAULT_VARIANTS
    names = _csv(args.variants if args.variants is not None else default, "variants")
    seeds = _csv(args.seeds, "seeds", int)
    if args.parallel < 1:
      raise GridError(f"--parallel={args.parallel}: must be >= 1")
    if not args.target_se > 0:
      raise GridError(f"--target_se={args.target_se}: must be > 0")
    variants, inits, runs = plan(args.config, names, seeds, args.workdir, overrides, args.shared_init,
                                 args.surface, args.surface_base)
    if not args.print_launch:
      check_workdir(args, [v.name for v in variants], seeds, overrides)
  except GridError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.print_launch:
    extra = shlex.split(args.launcher_args)
    for v in variants:
      if not v.available:
        print(f"# {v.name}: not available ({v.unavailable})")
    if inits:
      print("# 1. one warm start per seed (each seed's runs start from it)")
      for r in inits:
        print(launch_line(r, args.launcher, extra))
      print("# 2. the runs (after their seed's warm start has finished)")
    for r in runs:
      print(launch_line(r, args.launcher, extra))
    again = [a for a in argv if not a.startswith(("--print-launch", "--print_launch", "--launcher"))]
    print(f"# then: python -m jaxes.experiments.grid {shlex.join(again)} --aggregate-only")
    return 0
  if not args.aggregate_only:
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, "grid.json"), "w") as f:
      json.dump({"config": args.config, "variants": [v.name for v in variants], "surface": args.surface,
                 "surface_base": args.surface_base, "seeds": seeds, "overrides": overrides,
                 "runs": {r.name: r.command for r in inits + runs}}, f, indent=2)
    runner = LocalRunner(args.parallel)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
      runner.run_all(seed_major(inits, runs))
    except KeyboardInterrupt:
      print("grid: interrupted; stopping the runs (rerun the same command to resume)", file=sys.stderr)
      runner.stop()
      return 130
  result = write_results(variants, runs, seeds, args.workdir, args.target_se)
  complete = all(r["status"] == rundirs.FINISHED for r in result["runs"])
  return 0 if complete or args.aggregate_only else 1


if __name__ == "__main__":
  sys.exit(main())

"""Plays WebShop goals with a fixed agent; reports pass rate and mean reward.

  python -m jaxes.envs.check --env webshop --generated 500 --agent oracle
  python -m jaxes.envs.check --env webshop --data DIR --split heldout --goals 500 --agent first

Agents: ``oracle`` (plans with the goal, see ``agents``), ``noop`` (never buys), ``random``
(random words from the instruction, then random clicks; ``--agent random:SEED``), ``first``
(searches the instruction, buys the first result without options), ``replay:FILE`` (a JSON
list of raw model outputs, or an object mapping goal names to such lists, then noop). Prints a
per-category table, then one JSON line: {"goals", "passed", "pass_rate", "mean_reward",
"failures", "invalid_actions", "parse_errors", "leaked"}. Exit status 1 when a session leaked,
the oracle missed a goal or noop passed one.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sys

from jaxes.envs.checking import exit_status, read_replay
from jaxes.envs.webshop import agents, generator, loader, make_goals
from jaxes.envs.webshop.episode import MAX_STEPS, WebShopBackend, play

NO_PLAN = "NO_PLAN"     # the oracle found no r = 1 product within the step limit


def make_agent(spec: str, max_steps: int):
  """--agent spec -> factory: goal -> agent(messages) -> text (None: the oracle has no plan)."""
  if spec == "noop":
    return lambda goal: agents.noop()
  if spec == "oracle":
    def oracle(goal):
      replies = agents.oracle_replies(goal, max_steps)
      return None if replies is None else agents.scripted(replies)
    return oracle
  if spec == "random" or spec.startswith("random:"):
    try:
      seed = int(spec.partition(":")[2] or 0)
    except ValueError:
      raise SystemExit(f"--agent {spec}: expected random or random:SEED (an integer)")
    return lambda goal: agents.random_agent(goal, seed)
  if spec == "first":
    return agents.first_result_agent
  if spec.startswith("replay:"):
    data = read_replay(spec, "goal")
    return lambda goal: agents.scripted(data if isinstance(data, list) else data.get(goal.name, []))
  raise SystemExit(f"--agent {spec!r}: expected oracle, noop, random[:SEED], first or replay:FILE")


def run_checks(goals, agent_spec: str, *, max_steps: int = MAX_STEPS, workers: int = 1):
  """Plays every goal; returns ([(goal, outcome or NO_PLAN)] in goal order, sessions leaked)."""
  factory = make_agent(agent_spec, max_steps)
  backend = WebShopBackend()

  def one(goal):
    agent = factory(goal)
    if agent is None:
      return goal, NO_PLAN
    return goal, play(backend, goal, agent, max_steps=max_steps)[0]

  with concurrent.futures.ThreadPoolExecutor(max(workers, 1)) as pool:
    results = list(pool.map(one, goals))
  backend.shutdown()
  return results, sum(backend.leftovers().values())


def summarize(results, leaked: int) -> dict:
  outcomes = [o for _, o in results if not isinstance(o, str)]
  failures = collections.Counter()
  for _, o in results:
    if isinstance(o, str):
      failures[o] += 1
    elif not o.passed:
      failures[o.failure or "WRONG_PURCHASE"] += 1
  passed = sum(o.passed for o in outcomes)
  return {"goals": len(results), "passed": passed,
          "pass_rate": passed / len(results) if results else 0.0,
          "mean_reward": sum(o.fraction for o in outcomes) / len(results) if results else 0.0,
          "failures": dict(sorted(failures.items())),
          "invalid_actions": sum(o.timings["invalid_actions"] for o in outcomes),
          "parse_errors": sum(o.parse_errors for o in outcomes), "leaked": leaked}


def category_table(results) -> str:
  rows = collections.defaultdict(list)
  for goal, o in results:
    rows[goal.category or "-"].append(o)
  lines = [f"{'category':<14} {'goals':>5} {'passed':>6} {'rate':>6} {'reward':>6} {'steps':>5}"]
  for category in sorted(rows):
    outs = [o for o in rows[category] if not isinstance(o, str)]
    n, p = len(rows[category]), sum(o.passed for o in outs)
    reward = sum(o.fraction for o in outs) / n
    steps = sum(o.turns for o in outs) / max(len(outs), 1)
    lines.append(f"{category:<14} {n:>5} {p:>6} {p / n:>6.0%} {reward:>6.3f} {steps:>5.1f}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jaxes.envs.check --env webshop", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--generated", type=int, metavar="N", help="N goals of the generated catalog")
  src.add_argument("--data", metavar="DIR", help="a folder with the released WebShop files")
  ap.add_argument("--goals", type=int, default=500, metavar="N", help="with --data: goals to play")
  ap.add_argument("--split", default="train", help="train | heldout (| dev with --data)")
  ap.add_argument("--seed", type=int, default=0, help="goal seed")
  ap.add_argument("--num-products", type=int, default=0, help="catalog size (0: 1000 generated / all released)")
  ap.add_argument("--catalog-seed", type=int, default=0)
  ap.add_argument("--asin-length", type=int, default=generator.ASIN_LENGTH,
                  help="generated product ids' length, 'B0' included")
  ap.add_argument("--synthetic", action="store_true", help="with --data: synthetic instead of human goals")
  ap.add_argument("--max-steps", type=int, default=MAX_STEPS)
  ap.add_argument("--agent", default="oracle")
  ap.add_argument("--workers", type=int, default=1)
  args = ap.parse_args(argv)
  n = args.generated if args.data is None else args.goals
  if n < 1:
    ap.error("the number of goals must be at least 1")
  if args.max_steps < 1:
    ap.error("--max-steps must be at least 1")
  splits = tuple(loader.SPLIT_RANGES) if args.data else generator.SPLITS
  if args.split not in splits:
    ap.error(f"--split must be one of {splits}")
  make_agent(args.agent, args.max_steps)   # fail on a bad --agent before building anything
  try:
    goals = make_goals(args.split, n, args.seed, data_path=args.data or "",
                       num_products=args.num_products, catalog_seed=args.catalog_seed,
                       human_goals=not args.synthetic, max_steps=args.max_steps,
                       asin_length=args.asin_length)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(str(e))
  results, leaked = run_checks(goals, args.agent, max_steps=args.max_steps, workers=args.workers)
  summary = summarize(results, leaked)
  print(category_table(results))
  print(json.dumps(summary))
  return exit_status(args.agent, summary["passed"], summary["goals"], leaked)


if __name__ == "__main__":
  sys.exit(main())

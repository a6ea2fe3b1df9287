"""WebShop environment throughput alone (no model): env steps per second on one thread.

  python benchmarks/webshop_env.py --goals 300 --num-products 1000

Plays generated goals with the oracle (search, clicks, buy), the random agent (more searches,
aimless clicks) and, as a search-heavy worst case, an agent that searches, goes back and
searches again every turn. Only the environment's own time is counted: session start,
``WebShopEpisode.step`` (parse, page transition, BM25 search, rendering, the reward at Buy
Now) and ``finish``; the agent's time is not. Also times the two kinds of step separately
(search vs click, wall clock) and the catalog build. steps/s is wall clock; steps/cpu-s divides
by this thread's CPU time, which a loaded machine disturbs less. Prints a table and, last, one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time

from jaxes.envs.webshop import WebShopBackend, WebShopEpisode, agents, generator, make_goals


def search_heavy(goal):
  words = goal.instruction.split()
  rng = random.Random(goal.name)
  state = {"on_search": True}

  def act(messages):
    if state["on_search"]:
      state["on_search"] = False
      return f"search[{' '.join(rng.sample(words, min(len(words), 5)))}]"
    state["on_search"] = True
    return "click[Back to Search]"
  return act


def measure(goals, make_agent, label: str) -> dict:
  backend = WebShopBackend()
  env_s, cpu_s, steps, kinds = 0.0, 0.0, 0, {"search": [0.0, 0], "click": [0.0, 0]}
  for goal in goals:
    agent = make_agent(goal)
    t, c = time.perf_counter(), time.thread_time()
    handle = backend.start(goal)
    episode = WebShopEpisode(goal, handle)
    env_s += time.perf_counter() - t
    cpu_s += time.thread_time() - c
    done = False
    while not done:
      text = agent(episode.messages)
      t, c = time.perf_counter(), time.thread_time()
      done = episode.step(text)
      dt = time.perf_counter() - t
      env_s += dt
      cpu_s += time.thread_time() - c
      steps += 1
      kind = kinds["search" if text.startswith("search[") else "click"]
      kind[0] += dt
      kind[1] += 1
    t, c = time.perf_counter(), time.thread_time()
    episode.finish()
    handle.close()
    env_s += time.perf_counter() - t
    cpu_s += time.thread_time() - c
  return {"agent": label, "episodes": len(goals), "steps": steps, "env_s": env_s,
          "steps_per_s": steps / env_s, "cpu_s": cpu_s, "steps_per_cpu_s": steps / cpu_s,
          "search_ms": 1e3 * kinds["search"][0] / max(kinds["search"][1], 1),
          "click_ms": 1e3 * kinds["click"][0] / max(kinds["click"][1], 1)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--goals", type=int, default=300)
  ap.add_argument("--num-products", type=int, default=1000)
  args = ap.parse_args()
  t = time.perf_counter()
  generator.catalog(args.num_products, 0)
  catalog_s = time.perf_counter() - t
  t = time.perf_counter()
  goals = make_goals("train", args.goals, seed=0, num_products=args.num_products)
  goals_s = time.perf_counter() - t
  # Warm-up (first searches touch the index's arrays), then the measured runs.
  measure(goals[:20], lambda g: agents.scripted(agents.oracle_replies(g)), "warm-up")
  rows = [measure(goals, lambda g: agents.scripted(agents.oracle_replies(g)), "oracle"),
          measure(goals, lambda g: agents.random_agent(g, 0), "random"),
          measure(goals, search_heavy, "search-heavy")]
  print(f"{'agent':<13} {'episodes':>8} {'steps':>6} {'steps/s':>8} {'steps/cpu-s':>11} "
        f"{'search ms':>9} {'click ms':>8}")
  for r in rows:
    print(f"{r['agent']:<13} {r['episodes']:>8} {r['steps']:>6} {r['steps_per_s']:>8.0f} "
          f"{r['steps_per_cpu_s']:>11.0f} {r['search_ms']:>9.3f} {r['click_ms']:>8.3f}")
  print(f"catalog build ({args.num_products} products, BM25 index): {catalog_s:.2f} s; "
        f"{args.goals} goals (each checked by the oracle): {goals_s:.2f} s")
  print(json.dumps({"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "num_products": args.num_products, "catalog_s": catalog_s, "goals_s": goals_s,
                    "rows": rows}))


if __name__ == "__main__":
  main()

r"""``python -m jaxes.run_tools.atif --workdir=W [--out=W/trajectories.atif.jsonl]``: the sampled
episodes (``episodes.jsonl``) as ATIF trajectories, one JSON object a line. ATIF is the Agent
Trajectory Interchange Format of the Harbor project (its RFC 0001, v1.4).

How the fields map: ``session_id`` names the run, update, policy version, member, episode and
task; ``agent`` is jaxes with the policy's model and (in ``extra``) its version and member. The
prompt becomes a ``system`` step and a ``user`` step (one ``user`` step if its ChatML roles cannot
be told apart); each model turn an ``agent`` step whose ``message`` is the turn's text, with one
``bash`` tool call when the terminal protocol parses a ``<command>`` from it and the next
observation as that call's ``observation.results[0]``. Reward, success, failure and truncation go
to ``final_metrics.extra`` (ATIF has no reward field at the trajectory level). Texts are the
sample's, so cut to ``train.transcript_chars``; timestamps and token counts are not recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jaxes
from jaxes.envs.protocol import parse_action
from jaxes.train.transcripts import EPISODES, read_episodes

SCHEMA_VERSION = "ATIF-v1.4"


def _prompt_steps(text: str) -> list[tuple[str, str]]:
  """The decoded ChatML prompt ("system\n...\nuser\n...\nassistant") as (source, message)."""
  body = text.removesuffix("assistant").rstrip("\n")
  if body.startswith("system\n") and "\nuser\n" in body:
    system, user = body[len("system\n"):].split("\nuser\n", 1)
    return [("system", system), ("user", user)]
  return [("user", body)]


def trajectory(episode: dict, run: str, model_name: str) -> dict:
  session = (f"{run}/u{episode.get('update')}/v{episode.get('version')}/m{episode.get('member')}"
             f"/e{episode.get('episode', 0)}/{episode.get('task')}")
  steps: list[dict] = []
  turns = episode.get("transcript", [])
  for i, turn in enumerate(turns):
    if turn["role"] == "prompt":
      steps += [{"source": s, "message": m} for s, m in _prompt_steps(turn["text"])]
    elif turn["role"] == "model":
      step = {"source": "agent", "message": turn["text"]}
      action = parse_action(turn["text"])
      if action.kind == "command":
        call = f"call_{len(steps) + 1}"
        step["tool_calls"] = [{"tool_call_id": call, "function_name": "bash",
                               "arguments": {"command": action.command}}]
        following = turns[i + 1] if i + 1 < len(turns) else None
        if following is not None and following["role"] == "observation":
          step["observation"] = {"results": [{"source_call_id": call, "content": following["text"]}]}
      elif i + 1 < len(turns) and turns[i + 1]["role"] == "observation":
        # No command (done, or a reply the protocol rejects): the environment still answered.
        step["observation"] = {"results": [{"content": turns[i + 1]["text"]}]}
      steps.append(step)
  for n, step in enumerate(steps, 1):
    step["step_id"] = n
  return {"schema_version": SCHEMA_VERSION, "session_id": session,
          "agent": {"name": "jaxes", "version": jaxes.__version__, "model_name": model_name,
                    "extra": {"policy_version": episode.get("version"), "member": episode.get("member")}},
          "steps": [{"step_id": s.pop("step_id"), **s} for s in steps],
          "final_metrics": {"total_steps": len(steps),
                            "extra": {k: episode.get(k) for k in ("reward", "passed", "failure",
                                                                  "truncated", "turns", "update")}}}


def export(workdir: str, out: str | None = None) -> tuple[str, int]:
  """Writes every sampled episode of ``workdir`` as ATIF; returns (path, trajectories)."""
  out = out or os.path.join(workdir, "trajectories.atif.jsonl")
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      model = json.load(f).get("model", {})
  except (OSError, ValueError):
    model = {}
  model_name = model.get("path") or f"jaxes preset {model.get('preset', '?')}"
  run = os.path.basename(os.path.abspath(workdir))
  episodes = read_episodes(os.path.join(workdir, EPISODES))
  # json.dumps escapes what is not ASCII, lone surrogates (a non-UTF-8 task name) included.
  with open(out + ".tmp", "w", encoding="ascii") as f:
    f.writelines(json.dumps(trajectory(e, run, model_name), ensure_ascii=True) + "\n"
                 for e in episodes)
  os.replace(out + ".tmp", out)
  return out, len(episodes)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxes.run_tools.atif", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="a run directory with episodes.jsonl")
  p.add_argument("--out", default=None, help="default WORKDIR/trajectories.atif.jsonl")
  args = p.parse_args(argv)
  if not os.path.isfile(os.path.join(args.workdir, EPISODES)):
    print(f"error: --workdir={args.workdir}: no {EPISODES} (train.transcripts_per_update = 0?)", file=sys.stderr)
    return 2
  path, n = export(args.workdir, args.out)
  print(f"{n} trajectories in {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Procedural task families: each ``make(rng, difficulty) -> Draft`` builds one task.

A draft is everything but the bookkeeping: the instruction, the initial files (under
/home/user), an optional bash set-up (modes, mtimes), a stdlib-only final-test file and a bash
oracle. Families use only ``rng`` for randomness, so (family, seed, difficulty) fixes the task.
"""
from __future__ import annotations

import dataclasses
import random
import textwrap

HOME = "/home/user"

WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
         "juniper", "kestrel", "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven",
         "sierra", "tundra", "umber", "violet", "willow", "xenon", "yarrow", "zephyr")
NAMES = ("alice", "bruno", "chen", "dara", "elif", "farah", "goran", "hana", "ivan", "jonas",
         "kemal", "lena", "mira", "nils", "omar", "priya", "quinn", "rosa", "sven", "tariq",
         "uma", "vera", "wei", "yusuf", "zoe")
SERVICES = ("auth", "billing", "cache", "gateway", "indexer", "mailer", "scheduler", "storage")


@dataclasses.dataclass(frozen=True)
class Draft:
  instruction: str
  final_tests: str
  solution: str
  files: dict[str, bytes] = dataclasses.field(default_factory=dict)
  setup: str = ""


def test_file(body: str, imports: str = "os", **constants) -> str:
  """A final-test module: imports, the task's expected values as constants, then tests."""
  consts = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
  return (f'"""Final-state tests (generated; stdlib only)."""\nimport {imports}\n\n'
          f"{consts}\n{textwrap.dedent(body).strip()}\n")


def pick(rng: random.Random, pool, k: int) -> list:
  return rng.sample(list(pool), k)


def token(rng: random.Random, n: int = 8) -> str:
  return "".join(rng.choice("abcdefghijkmnpqrstuvwxyz23456789") for _ in range(n))


def lines_bytes(lines) -> bytes:
  return "".join(f"{line}\n" for line in lines).encode()

"""Families that ask for a small program or a multi-step pipeline."""
from __future__ import annotations

import collections
import gzip
import random

from jaxes.envs.tasks.families import HOME, NAMES, WORDS, Draft, lines_bytes, pick, test_file, token


def shell_script(rng: random.Random, difficulty: int) -> Draft:
  name = f"{rng.choice(WORDS)}_{token(rng, 3)}.sh"
  path = f"{HOME}/bin/{name}"
  if difficulty == 1:
    greeting = rng.choice(("Hello", "Welcome", "Greetings"))
    spec = f"prints '{greeting}, NAME!' where NAME is its first argument"
    body = f'echo "{greeting}, $1!"'
    cases = [([n], f"{greeting}, {n}!") for n in pick(rng, NAMES, 3)]
    setup_files = {}
  elif difficulty == 2:
    spec = "prints the number of lines of the file given as its first argument (just the number)"
    body = 'wc -l < "$1" | tr -d " "'
    setup_files = {f"{HOME}/test_inputs/case_{i}.txt": "".join(f"{token(rng)}\n" for _ in range(n))
                   for i, n in enumerate(rng.sample(range(1, 40), 3))}
    cases = [([p], str(c.count("\n"))) for p, c in setup_files.items()]
  else:
    ext = rng.choice(("log", "csv", "txt"))
    spec = ("takes a directory as its first argument and an extension (without the dot) as its "
            "second, and prints how many regular files directly in that directory have that "
            "extension (just the number)")
    body = 'find "$1" -maxdepth 1 -type f -name "*.$2" | wc -l'
    setup_files, cases = {}, []
    for i, n in enumerate(rng.sample(range(0, 9), 3)):
      d = f"{HOME}/test_inputs/case_{i}"
      for j in range(n):
        setup_files[f"{d}/f{j}.{ext}"] = "x\n"
      setup_files[f"{d}/other.{ext}x"] = "y\n"
      setup_files[f"{d}/sub/deep.{ext}"] = "z\n"
      cases.append(([d, ext], str(n)))
  instruction = (f"Write an executable bash script {path} (create {HOME}/bin if needed) that "
                 f"{spec}.")
  tests = test_file("""
      def make_inputs():
        for p, content in INPUTS.items():
          os.makedirs(os.path.dirname(p), exist_ok=True)
          with open(p, "w") as f:
            f.write(content)

      def test_executable():
        assert os.path.isfile(SCRIPT), f"{SCRIPT} does not exist"
        assert os.access(SCRIPT, os.X_OK), f"{SCRIPT} is not executable"

      def test_behaviour():
        make_inputs()
        for args, want in CASES:
          out = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=10)
          got = out.stdout.strip()
          assert got == want, f"{SCRIPT} {' '.join(args)} printed {got!r}, expected {want!r}"
      """, imports="os, subprocess", SCRIPT=path, INPUTS=setup_files, CASES=cases)
  solution = (f"mkdir -p {HOME}/bin && printf '%s\\n' '#!/bin/bash' '{body}' > {path} "
              f"&& chmod +x {path}")
  return Draft(instruction, tests, solution)


def pipeline(rng: random.Random, difficulty: int) -> Draft:
  users = pick(rng, NAMES, 4 + difficulty)
  # Distinct upload totals per user, so the ranking has one answer.
  totals_wanted = dict(zip(users, rng.sample(range(1, 60), len(users))))
  events = []
  for user, units in totals_wanted.items():
    remaining = units * 100
    while remaining > 0:
      chunk = min(remaining, rng.randint(1, 25) * 100)
      events.append((user, "upload", chunk))
      remaining -= chunk
  deleters = set(rng.sample(users, rng.randint(1, len(users) - 1)))
  events += [(u, "delete", 0) for u in deleters]
  events += [(rng.choice(users), rng.choice(("login", "logout")), 0) for _ in range(15)]
  rng.shuffle(events)
  n_files = 1 if difficulty == 1 else 3
  chunks = [events[i::n_files] for i in range(n_files)]
  files = {}
  for i, chunk in enumerate(chunks):
    lines = lines_bytes(f"2024-05-{10 + i:02d}T{rng.randint(0, 23):02d}:00:00 user={u} "
                        f"action={a} bytes={b}" for u, a, b in chunk)
    if difficulty >= 3 and i == 0:   # the oldest log is compressed: it must be found and read
      files[f"{HOME}/logs/app-{i}.log.gz"] = gzip.compress(lines, mtime=0)
    else:
      files[f"{HOME}/logs/app-{i}.log"] = lines
  uploads = collections.Counter()
  for u, a, b in events:
    if a == "upload":
      uploads[u] += b
  ranking = [f"{u} {t}" for u, t in sorted(uploads.items(), key=lambda kv: -kv[1])]
  sources = "every log file in " + f"{HOME}/logs" + (" (including compressed ones)"
                                                      if difficulty >= 3 else "")
  instruction = (f"Lines in {sources} look like 'TIMESTAMP user=NAME action=ACTION bytes=N'. "
                 f"Create {HOME}/reports/uploads.txt listing, for action=upload, each user's total "
                 "bytes as 'NAME TOTAL' lines sorted by total, largest first")
  tests_body = """
      def read(path):
        assert os.path.isfile(path), f"{path} does not exist"
        with open(path) as f:
          return [" ".join(l.split()) for l in f if l.strip()]

      def test_uploads():
        assert read(UPLOADS) == RANKING
      """
  consts = {"UPLOADS": f"{HOME}/reports/uploads.txt", "RANKING": ranking}
  cat = f"cat {HOME}/logs/*.log" if difficulty < 3 else \
      f"{{ cat {HOME}/logs/*.log; zcat {HOME}/logs/*.gz; }}"
  solution = (f"mkdir -p {HOME}/reports && {cat} | grep 'action=upload' | "
              "sed 's/.*user=\\([^ ]*\\).*bytes=\\([0-9]*\\).*/\\1 \\2/' | "
              "awk '{ s[$1] += $2 } END { for (u in s) print u, s[u] }' | sort -k2,2nr "
              f"> {HOME}/reports/uploads.txt")
  if difficulty >= 2:
    instruction += (f", and write the number of distinct users with at least one action=delete "
                    f"to {HOME}/reports/deleters.txt")
    tests_body += """
      def test_deleters():
        assert read(DELETERS) == [str(N_DELETERS)]
      """
    consts.update(DELETERS=f"{HOME}/reports/deleters.txt", N_DELETERS=len(deleters))
    solution += (f" && {cat} | grep 'action=delete' | sed 's/.*user=\\([^ ]*\\).*/\\1/' | sort -u "
                 f"| wc -l > {HOME}/reports/deleters.txt")
  tests = test_file(tests_body, **consts)
  return Draft(instruction + ".", tests, solution, files)

"""Text-processing families: logs, frequency reports, CSV, JSON, configs, hidden values."""
from __future__ import annotations

import base64
import collections
import json
import random

from jaxes.envs.tasks.families import (HOME, NAMES, SERVICES, WORDS, Draft, lines_bytes, pick,
                                 test_file, token)

LEVELS = ("DEBUG", "INFO", "WARN", "ERROR")


def _answer_test(path: str, value: str) -> str:
  return test_file("""
      def test_answer():
        assert os.path.isfile(OUT), f"{OUT} does not exist"
        with open(OUT) as f:
          got = f.read().strip()
        assert got == EXPECTED, f"{OUT} contains {got!r}"
      """, OUT=path, EXPECTED=value)


def log_count(rng: random.Random, difficulty: int) -> Draft:
  service = rng.choice(SERVICES)
  hour = rng.randint(0, 23)
  log_name = f"{rng.choice(WORDS)}-{token(rng, 4)}.log"
  lines, count = [], 0
  for i in range(20 + 30 * difficulty):
    level = rng.choices(LEVELS, weights=(2, 5, 2, 2))[0]
    svc = rng.choice(SERVICES)
    h = rng.choice((hour, rng.randint(0, 23)))
    lines.append(f"2024-05-{rng.randint(10, 28):02d}T{h:02d}:{rng.randint(0, 59):02d}:"
                 f"{rng.randint(0, 59):02d} {level} {svc}: {rng.choice(WORDS)} {rng.choice(WORDS)}")
    wanted = (level == "ERROR" and (difficulty == 1 or svc == service)
              and (difficulty < 3 or h == hour))
    count += wanted
  if count == 0:
    lines.append(f"2024-05-11T{hour:02d}:00:00 ERROR {service}: forced failure")
    count = 1
  files = {f"{HOME}/logs/{log_name}": lines_bytes(lines),
           f"{HOME}/logs/README": b"Application logs live here.\n"}
  what = "ERROR lines"
  pattern = " ERROR "
  if difficulty >= 2:
    what = f"ERROR lines from the {service} service"
    pattern = f" ERROR {service}: "
  if difficulty >= 3:
    what += f" logged during hour {hour:02d} (timestamps T{hour:02d}:..:..)"
    pattern = f"T{hour:02d}:[0-9:]* ERROR {service}: "
  instruction = (f"The directory {HOME}/logs holds one .log file. Count its {what} and write "
                 f"just the number to {HOME}/error_count.txt.")
  solution = f"grep -c '{pattern}' {HOME}/logs/*.log > {HOME}/error_count.txt"
  return Draft(instruction, _answer_test(f"{HOME}/error_count.txt", str(count)), solution, files)


def freq_report(rng: random.Random, difficulty: int) -> Draft:
  top_k = (3, 5, 5)[difficulty - 1]
  only_status = "500" if difficulty >= 3 else None
  ips = [f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}" for _ in range(12)]
  ips = list(dict.fromkeys(ips))
  # Distinct counts for the leaders, so "top k" has exactly one answer.
  counts = dict(zip(ips, rng.sample(range(1, 40), len(ips))))
  lines = []
  for ip, n in counts.items():
    for _ in range(n):
      lines.append((ip, only_status or rng.choice(("200", "404", "500"))))
  noise = [(rng.choice(ips), rng.choice(("200", "404"))) for _ in range(30)] if only_status else []
  entries = lines + noise
  rng.shuffle(entries)
  log = [f'{ip} - - [12/May/2024:10:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} +0000] '
         f'"GET /{rng.choice(WORDS)} HTTP/1.1" {status} {rng.randint(100, 9999)}'
         for ip, status in entries]
  tally = collections.Counter(ip for ip, status in entries if not only_status or status == only_status)
  top = sorted(tally.items(), key=lambda kv: -kv[1])[:top_k]
  expected = [f"{n} {ip}" for ip, n in top]
  which = f"requests answered with status {only_status}" if only_status else "requests"
  instruction = (f"{HOME}/access.log is a web server access log (client IP first on each line). "
                 f"Write the {top_k} client IPs with the most {which} to {HOME}/top_ips.txt, one "
                 "per line as 'COUNT IP' (count, one space, IP), most frequent first.")
  tests = test_file("""
      def test_report():
        assert os.path.isfile(OUT), f"{OUT} does not exist"
        with open(OUT) as f:
          got = [" ".join(l.split()) for l in f if l.strip()]
        assert got == EXPECTED, f"got {got}, expected {EXPECTED}"
      """, OUT=f"{HOME}/top_ips.txt", EXPECTED=expected)
  filt = f"$9 == \"{only_status}\" " if only_status else ""
  solution = (f"awk '{filt}{{print $1}}' {HOME}/access.log | sort | uniq -c | sort -rn | "
              f"head -n {top_k} | awk '{{print $1\" \"$2}}' > {HOME}/top_ips.txt")
  return Draft(instruction, tests, solution, {f"{HOME}/access.log": lines_bytes(log)})


def csv_aggregate(rng: random.Random, difficulty: int) -> Draft:
  columns = ["id", "region", "product", "amount", "rep"]
  rng.shuffle(columns)   # the column order is only discoverable by reading the header
  regions = pick(rng, ("north", "south", "east", "west", "central", "coastal"), 2 + difficulty)
  products = pick(rng, WORDS, 3)
  product = products[0] if difficulty >= 2 else None
  rows, totals = [], collections.Counter()
  for i in range(8 + 8 * difficulty):
    row = {"id": str(1000 + i), "region": rng.choice(regions), "product": rng.choice(products),
           "amount": str(rng.randint(1, 500)), "rep": rng.choice(NAMES)}
    rows.append(",".join(row[c] for c in columns))
    if product is None or row["product"] == product:
      totals[row["region"]] += int(row["amount"])
  if not totals:
    rows.append(",".join({"id": "999", "region": regions[0], "product": product or products[0],
                          "amount": "7", "rep": "zoe"}[c] for c in columns))
    totals[regions[0]] += 7
  files = {f"{HOME}/data/sales.csv": lines_bytes([",".join(columns), *rows])}
  which = f"rows whose product is {product}" if product else "all rows"
  instruction = (f"{HOME}/data/sales.csv has a header row. Sum the amount column per region over "
                 f"{which} and write {HOME}/data/summary.csv with the header region,total and one "
                 "row per region (only regions with such rows), sorted by region name.")
  expected = [["region", "total"]] + [[r, str(totals[r])] for r in sorted(totals)]
  tests = test_file("""
      def test_summary():
        assert os.path.isfile(OUT), f"{OUT} does not exist"
        with open(OUT, newline="") as f:
          got = [[c.strip() for c in row] for row in csv.reader(f) if row]
        assert got == EXPECTED, f"got {got}, expected {EXPECTED}"
      """, imports="csv, os", OUT=f"{HOME}/data/summary.csv", EXPECTED=expected)
  cond = f'$h["product"] == "{product}"' if product else "1"
  solution = (f"cd {HOME}/data && {{ echo region,total; awk -F, 'NR == 1 {{ for (i = 1; i <= NF; i++) "
              f"h[$i] = i; next }} {cond} {{ s[$h[\"region\"]] += $h[\"amount\"] }} END {{ for (r in s) "
              f"print r \",\" s[r] }}' sales.csv | LC_ALL=C sort; }} > summary.csv")
  return Draft(instruction, tests, solution, files)


def json_extract(rng: random.Random, difficulty: int) -> Draft:
  team = rng.choice(("infra", "data", "web", "ml"))
  container = rng.choice(("records", "items", "entries", "people"))
  users, expected = [], []
  for name in pick(rng, NAMES, 6 + 3 * difficulty):
    user = {"id": rng.randint(100, 999), "name": name.capitalize(),
            "status": rng.choice(("active", "inactive", "suspended")),
            "team": rng.choice(("infra", "data", "web", "ml"))}
    users.append(user)
    if user["status"] == "active" and (difficulty == 1 or user["team"] == team):
      expected.append(user["name"])
  if not expected:
    users[0].update(status="active", team=team)
    expected.append(users[0]["name"])
  doc = {"generated": "2024-05-12", container: users} if difficulty >= 3 else users
  files = {f"{HOME}/data/users.json": json.dumps(doc, indent=2).encode()}
  who = "active users" + (f" in the {team} team" if difficulty >= 2 else "")
  instruction = (f"{HOME}/data/users.json describes user accounts. Write the names of all {who}, "
                 f"one per line, sorted alphabetically, to {HOME}/active_users.txt.")
  tests = test_file("""
      def test_names():
        assert os.path.isfile(OUT), f"{OUT} does not exist"
        with open(OUT) as f:
          got = [l.strip() for l in f if l.strip()]
        assert got == sorted(EXPECTED), f"got {got}, expected {sorted(EXPECTED)}"
      """, OUT=f"{HOME}/active_users.txt", EXPECTED=expected)
  get = f"json.load(open('{HOME}/data/users.json'))" + (f"['{container}']" if difficulty >= 3 else "")
  cond = "u['status'] == 'active'" + (f" and u['team'] == '{team}'" if difficulty >= 2 else "")
  solution = (f"python3 -c \"import json; print('\\n'.join(sorted(u['name'] for u in {get} "
              f"if {cond})))\" > {HOME}/active_users.txt")
  return Draft(instruction, tests, solution, files)


def config_edit(rng: random.Random, difficulty: int) -> Draft:
  port, new_port = rng.sample(range(2000, 9999), 2)
  workers = rng.randint(2, 16)
  sections = {
      "server": {"host": "0.0.0.0", "port": str(port), "workers": str(workers)},
      "logging": {"level": "info", "file": f"/var/log/{rng.choice(WORDS)}.log"},
      "cache": {"enabled": "true", "ttl_seconds": str(rng.randint(30, 600))},
  }
  lines = []
  for name, kv in sections.items():
    lines += [f"[{name}]", *(f"{k} = {v}" for k, v in kv.items()), ""]
  app = rng.choice(WORDS)
  path = f"{HOME}/{app}/settings.ini"
  expected = {s: dict(kv) for s, kv in sections.items()}
  expected["server"]["port"] = str(new_port)
  asks = [f"set port in the [server] section to {new_port}"]
  solution = [f"sed -i 's/^port = .*/port = {new_port}/' {path}"]
  if difficulty >= 2:
    expected["logging"]["level"] = "debug"
    asks.append("set level in the [logging] section to debug")
    solution.append(f"sed -i 's/^level = .*/level = debug/' {path}")
  if difficulty >= 3:
    max_conn = rng.randint(50, 500)
    expected["server"]["max_connections"] = str(max_conn)
    asks.append(f"add the setting max_connections = {max_conn} to the [server] section")
    solution.append(f"sed -i '/^\\[server\\]/a max_connections = {max_conn}' {path}")
  instruction = (f"Edit the INI file {path}: " + "; ".join(asks) +
                 ". Keep every other setting as it is.")
  tests = test_file("""
      def test_settings():
        parser = configparser.ConfigParser(interpolation=None)
        assert parser.read(PATH), f"cannot read {PATH}"
        got = {s: dict(parser[s]) for s in parser.sections()}
        assert got == EXPECTED, f"settings are {got}"
      """, imports="configparser, os", PATH=path, EXPECTED=expected)
  return Draft(instruction, tests, " && ".join(solution), {path: lines_bytes(lines)})


def secret_lookup(rng: random.Random, difficulty: int) -> Draft:
  secret = token(rng, 20)
  key = "api_token"
  stored = secret
  if difficulty >= 2:
    key = "api_token_b64"
    stored = base64.b64encode(secret.encode()).decode()
  files, paths = {}, []
  for i in range(6 + 6 * difficulty):
    parts = pick(rng, WORDS, rng.randint(1, difficulty + 1))
    path = f"{HOME}/vault/{'/'.join(parts)}/{rng.choice(WORDS)}_{i}.txt"
    paths.append(path)
    files[path] = lines_bytes(f"{rng.choice(('user', 'host', 'note'))}={token(rng, 12)}"
                              for _ in range(rng.randint(2, 6)))
  holder = rng.choice(paths)
  content = files[holder].decode().splitlines()
  content.insert(rng.randrange(len(content) + 1), f"{key}={stored}")
  files[holder] = lines_bytes(content)
  how = "base64-encoded, " if difficulty >= 2 else ""
  instruction = (f"Somewhere under {HOME}/vault one file contains a line {key}=... holding an API "
                 f"token ({how}find it). Write the plain token to {HOME}/token.txt.")
  decode = " | base64 -d" if difficulty >= 2 else ""
  solution = (f"grep -rh '^{key}=' {HOME}/vault | cut -d= -f2-{decode} > {HOME}/token.txt")
  if difficulty >= 3:
    instruction += " Then delete the file that held it."
    solution += f" && rm \"$(grep -rl '^{key}=' {HOME}/vault)\""
    tests = test_file("""
        def test_token():
          with open(OUT) as f:
            assert f.read().strip() == EXPECTED

        def test_holder_deleted():
          assert not os.path.exists(HOLDER), f"{HOLDER} still exists"

        def test_others_kept():
          for p in OTHERS:
            assert os.path.isfile(p), f"{p} was removed"
        """, OUT=f"{HOME}/token.txt", EXPECTED=secret, HOLDER=holder,
                      OTHERS=[p for p in paths if p != holder])
  else:
    tests = _answer_test(f"{HOME}/token.txt", secret)
  return Draft(instruction, tests, solution, files)

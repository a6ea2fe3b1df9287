"""File-system families: create, edit, find, rename, permissions, archives."""
from __future__ import annotations

import gzip
import io
import random
import shlex
import tarfile

from jaxes.envs.tasks.families import HOME, NAMES, WORDS, Draft, lines_bytes, pick, test_file, token


def create_file(rng: random.Random, difficulty: int) -> Draft:
  dirs = pick(rng, WORDS, difficulty)
  path = "/".join([HOME, *dirs, f"{rng.choice(WORDS)}_{token(rng, 4)}.txt"])
  lines = [f"{rng.choice(NAMES)} {rng.choice(WORDS)} {rng.randint(1, 999)}"
           for _ in range(difficulty + 1)]
  listing = "\n".join(lines)
  instruction = (f"Create the file {path} (create missing directories) containing exactly these "
                 f"{len(lines)} lines, each ending with a newline and nothing else:\n{listing}")
  tests = test_file("""
      def test_file_exists():
        assert os.path.isfile(PATH), f"{PATH} does not exist"

      def test_content_exact():
        with open(PATH) as f:
          content = f.read()
        assert content == EXPECTED, f"content of {PATH} is {content!r}, expected {EXPECTED!r}"
      """, PATH=path, EXPECTED="".join(f"{l}\n" for l in lines))
  quoted = " ".join(shlex.quote(l) for l in lines)
  solution = (f"mkdir -p {shlex.quote(path.rsplit('/', 1)[0])} && "
              f"printf '%s\\n' {quoted} > {shlex.quote(path)}")
  return Draft(instruction, tests, solution)


def edit_file(rng: random.Random, difficulty: int) -> Draft:
  old, new = (w.upper() + "_" + token(rng, 3).upper() for w in pick(rng, WORDS, 2))
  names = pick(rng, WORDS, 2 + 2 * difficulty)
  target = f"{names[0]}.md"
  files = {}
  for i, name in enumerate(names):
    ext = "md" if i == 0 else rng.choice(("txt", "cfg", "log"))
    lines = []
    for _ in range(4 + 3 * difficulty):
      words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
      if rng.random() < 0.5:   # the word to replace shows up in distractor files too
        words.insert(rng.randrange(len(words) + 1), old)
      lines.append(" ".join(words))
    if i == 0 and not any(old in l for l in lines):
      lines[0] += f" {old}"
    files[f"{HOME}/docs/{name}.{ext}"] = lines_bytes(lines)
  expected = {p: c.decode().replace(old, new) if p.endswith(target) else c.decode()
              for p, c in files.items()}
  instruction = (f"There is exactly one Markdown (.md) file in {HOME}/docs. In that file only, "
                 f"replace every occurrence of {old} with {new}. Leave all other files unchanged.")
  tests = test_file("""
      def test_target_edited():
        for path, content in EXPECTED.items():
          with open(path) as f:
            actual = f.read()
          assert actual == content, f"{path} has unexpected content"

      def test_no_extra_md_files():
        mds = sorted(n for n in os.listdir(DOCS) if n.endswith(".md"))
        assert mds == [TARGET], f"Markdown files in {DOCS}: {mds}"
      """, EXPECTED=expected, DOCS=f"{HOME}/docs", TARGET=target)
  solution = f"sed -i 's/{old}/{new}/g' {HOME}/docs/*.md"
  return Draft(instruction, tests, solution, files)


def find_files(rng: random.Random, difficulty: int) -> Draft:
  threshold = rng.choice((2048, 4096, 8192))
  by_age = difficulty >= 2
  ext = rng.choice(("log", "dat", "bin"))
  files, setup, expected = {}, [], []
  subdirs = ["", *pick(rng, WORDS, 2 + difficulty)]
  for i in range(6 + 4 * difficulty):
    sub = rng.choice(subdirs)
    name = f"{rng.choice(WORDS)}_{i}.{rng.choice((ext, 'txt'))}"
    rel = f"{sub}/{name}" if sub else name
    big = rng.random() < 0.45
    size = rng.randint(threshold + 1, 3 * threshold) if big else rng.randint(10, threshold - 1)
    files[f"{HOME}/project/{rel}"] = (token(rng, 16) * (size // 16 + 1))[:size].encode()
    old = rng.random() < 0.5
    days = rng.randint(10, 40) if old else rng.randint(0, 2)
    setup.append(f"touch -d '{days} days ago' {shlex.quote(f'{HOME}/project/{rel}')}")
    if big and (not by_age or (old and rel.endswith(f".{ext}"))):
      expected.append(rel)
  if not expected:   # always at least one match, so an empty answer never passes
    rel = f"{subdirs[-1]}/forced.{ext}"
    files[f"{HOME}/project/{rel}"] = b"x" * (threshold * 2)
    setup.append(f"touch -d '20 days ago' {shlex.quote(f'{HOME}/project/{rel}')}")
    expected.append(rel)
  crit = f"larger than {threshold} bytes"
  find_args = f"-type f -size +{threshold}c"
  if by_age:
    crit = f"with the .{ext} extension, {crit}, and last modified more than 7 days ago"
    find_args += f" -name '*.{ext}' -mtime +7"
  instruction = (f"Find every regular file under {HOME}/project {crit}. Write their paths "
                 f"relative to {HOME}/project (like sub/name.ext), one per line, to "
                 f"{HOME}/found.txt.")
  tests = test_file("""
      def test_found_list():
        assert os.path.isfile(OUT), f"{OUT} does not exist"
        with open(OUT) as f:
          got = [l.strip() for l in f if l.strip()]
        got = [g[2:] if g.startswith("./") else g for g in got]
        assert len(got) == len(set(got)), "duplicate lines"
        assert sorted(got) == sorted(EXPECTED), f"found {sorted(got)}, expected {sorted(EXPECTED)}"
      """, OUT=f"{HOME}/found.txt", EXPECTED=expected)
  solution = f"cd {HOME}/project && find . {find_args} | sed 's|^\\./||' > {HOME}/found.txt"
  return Draft(instruction, tests, solution, files, "\n".join(setup))


def bulk_rename(rng: random.Random, difficulty: int) -> Draft:
  src_ext, dst_ext = rng.choice((("jpeg", "jpg"), ("htm", "html"), ("yml", "yaml"), ("text", "txt")))
  prefix = f"{rng.choice(WORDS)}_" if difficulty >= 2 else ""
  into = "sorted" if difficulty >= 3 else ""
  files, expected = {}, {}
  for i in rng.sample(range(1, 999), 4 + 2 * difficulty):
    matches = rng.random() < 0.6 or not expected
    name = f"item_{i:03d}.{src_ext if matches else rng.choice(('png', 'md', src_ext + '.bak'))}"
    content = f"{name} {token(rng)}\n".encode()
    files[f"{HOME}/inbox/{name}"] = content
    if matches:
      new = f"{prefix}{name[:-len(src_ext)]}{dst_ext}"
      expected[f"{into}/{new}" if into else new] = content.decode()
    else:
      expected[name] = content.decode()
  how = f"to end in .{dst_ext} instead"
  if prefix:
    how += f" and to start with the prefix {prefix}"
  if into:
    how += f", moving them into the new directory {HOME}/inbox/{into}"
  instruction = (f"In {HOME}/inbox, rename every file whose name ends in .{src_ext} {how}. "
                 "Do not change any other file, and keep every file's content.")
  tests = test_file("""
      def listing():
        out = {}
        for dirpath, _, names in os.walk(ROOT):
          for n in names:
            p = os.path.join(dirpath, n)
            with open(p) as f:
              out[os.path.relpath(p, ROOT)] = f.read()
        return out

      def test_names():
        assert sorted(listing()) == sorted(EXPECTED)

      def test_contents_kept():
        assert listing() == EXPECTED
      """, ROOT=f"{HOME}/inbox", EXPECTED=expected)
  dest = f"{into}/{prefix}" if into else prefix
  mk = f"mkdir -p {into} && " if into else ""
  solution = (f"cd {HOME}/inbox && {mk}for f in *.{src_ext}; do "
              f"mv -- \"$f\" \"{dest}${{f%.{src_ext}}}.{dst_ext}\"; done")
  return Draft(instruction, tests, solution, files)


def permissions(rng: random.Random, difficulty: int) -> Draft:
  scripts = [f"{w}.sh" for w in pick(rng, WORDS, 2 + difficulty)]
  others = [f"{w}.txt" for w in pick(rng, WORDS, 2)]
  files = {f"{HOME}/bin/{n}": b"#!/bin/bash\necho ok\n" for n in scripts}
  files.update({f"{HOME}/bin/{n}": b"notes\n" for n in others})
  setup = [f"chmod 644 {HOME}/bin/*"]
  expected = {f"{HOME}/bin/{n}": 0o755 for n in scripts}
  expected.update({f"{HOME}/bin/{n}": 0o644 for n in others})
  asks = [f"make every .sh file in {HOME}/bin have mode 755 (other files there stay 644)"]
  if difficulty >= 2:
    key = f"{rng.choice(WORDS)}.pem"
    files[f"{HOME}/secrets/{key}"] = f"KEY {token(rng, 24)}\n".encode()
    setup.append(f"chmod 755 {HOME}/secrets && chmod 666 {HOME}/secrets/{key}")
    expected.update({f"{HOME}/secrets": 0o700, f"{HOME}/secrets/{key}": 0o600})
    asks.append(f"make {HOME}/secrets accessible only to its owner (mode 700) and the file in it "
                "readable and writable only by its owner (mode 600)")
  if difficulty >= 3:
    shared = [f"{w}.txt" for w in pick(rng, WORDS, 3)]
    files.update({f"{HOME}/shared/{n}": b"shared\n" for n in shared})
    setup.append(f"chmod 666 {HOME}/shared/*")
    expected.update({f"{HOME}/shared/{n}": 0o644 for n in shared})
    asks.append(f"remove write permission for group and others from every file in {HOME}/shared")
  instruction = "Fix file permissions: " + "; ".join(asks) + "."
  tests = test_file("""
      def test_modes():
        for path, mode in EXPECTED.items():
          actual = os.stat(path).st_mode & 0o777
          assert actual == mode, f"{path} has mode {oct(actual)}, expected {oct(mode)}"
      """, EXPECTED=expected)
  solution = [f"chmod 755 {HOME}/bin/*.sh"]
  if difficulty >= 2:
    solution.append(f"chmod 700 {HOME}/secrets && chmod 600 {HOME}/secrets/*")
  if difficulty >= 3:
    solution.append(f"chmod go-w {HOME}/shared/*")
  return Draft(instruction, tests, " && ".join(solution), files, "\n".join(setup))


def _tar_gz(members: dict[str, bytes]) -> bytes:
  """A byte-identical .tar.gz for the same members (fixed mtimes), so tasks stay deterministic."""
  raw = io.BytesIO()
  with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
      tar.addfile(info, io.BytesIO(data))
  return gzip.compress(raw.getvalue(), mtime=0)


def archive(rng: random.Random, difficulty: int) -> Draft:
  if difficulty >= 3:   # exploration: unpack a bundle and find one value inside it
    key, value = "build_id", token(rng, 10)
    members = {f"bundle/{w}/README": f"{w} docs\n".encode() for w in pick(rng, WORDS, 3)}
    conf = f"bundle/{rng.choice(WORDS)}/{rng.choice(('app', 'svc', 'core'))}.conf"
    members[conf] = f"name = {rng.choice(WORDS)}\n{key} = {value}\nworkers = 4\n".encode()
    files = {f"{HOME}/incoming/bundle.tar.gz": _tar_gz(members)}
    instruction = (f"{HOME}/incoming/bundle.tar.gz contains a configuration file that sets "
                   f"{key}. Extract the archive into {HOME}/incoming and write that {key} value "
                   f"(just the value) to {HOME}/build_id.txt.")
    tests = test_file("""
        def test_extracted():
          assert os.path.isfile(CONF), f"{CONF} was not extracted"

        def test_value():
          with open(OUT) as f:
            assert f.read().strip() == VALUE
        """, CONF=f"{HOME}/incoming/{conf}", OUT=f"{HOME}/build_id.txt", VALUE=value)
    solution = (f"cd {HOME}/incoming && tar -xzf bundle.tar.gz && grep -rh '^{key}' bundle "
                f"| sed 's/.*= *//' > {HOME}/build_id.txt")
    return Draft(instruction, tests, solution, files)
  project = rng.choice(WORDS)
  files, expected = {}, {}
  for i in range(3 + 2 * difficulty):
    sub = rng.choice(("", "src/", "docs/"))
    name = f"{sub}{rng.choice(WORDS)}_{i}.{rng.choice(('py', 'md', 'txt', 'tmp'))}"
    data = f"{name} {token(rng)}\n".encode()
    files[f"{HOME}/{project}/{name}"] = data
    if difficulty == 1 or not name.endswith(".tmp"):
      expected[f"{project}/{name}"] = data.decode()
  out = f"{HOME}/backup/{project}.tar.gz"
  excl = ", leaving out every file ending in .tmp" if difficulty == 2 else ""
  instruction = (f"Create the gzip-compressed tar archive {out} (create {HOME}/backup if needed) "
                 f"of the directory {HOME}/{project}{excl}. Paths inside the archive must start "
                 f"with {project}/ (as produced by running tar from {HOME}).")
  tests = test_file("""
      def test_archive():
        assert os.path.isfile(OUT), f"{OUT} does not exist"
        with tarfile.open(OUT, "r:gz") as tar:
          got = {}
          for m in tar.getmembers():
            if m.isfile():
              name = m.name[2:] if m.name.startswith("./") else m.name
              got[name] = tar.extractfile(m).read().decode()
        assert sorted(got) == sorted(EXPECTED), f"archive files {sorted(got)}"
        assert got == EXPECTED, "archived contents differ"
      """, imports="os, tarfile", OUT=out, EXPECTED=expected)
  exclude = "--exclude='*.tmp' " if difficulty == 2 else ""
  solution = f"mkdir -p {HOME}/backup && cd {HOME} && tar -czf {out} {exclude}{project}"
  return Draft(instruction, tests, solution, files)

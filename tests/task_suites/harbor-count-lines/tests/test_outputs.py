import subprocess


def test_count_matches_tally():
  marked = subprocess.run(["tally", "/app/data.txt"], capture_output=True, text=True, check=True)
  want = sum(line.startswith("keep ") for line in marked.stdout.splitlines())
  assert open("/app/count.txt").read().strip() == str(want)

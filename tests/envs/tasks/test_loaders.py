"""Task-folder loaders (Endless Terminals, Terminal-Bench / Harbor): no container engine needed."""
import json
import os
import stat
import subprocess
import textwrap

import pytest

from jaxes.envs.tasks import loaders
from jaxes.envs.tasks.loaders import TaskLoadError, load_task, load_tasks, translate_shell

FINAL_TESTS = textwrap.dedent("""\
  import os
  import pytest

  def test_report():
    assert open("/home/user/report.txt").read() == "3\\n"
  """)

CONTAINER_DEF = textwrap.dedent("""\
  Bootstrap: localimage
  From: ./ubuntu_22.04.sif

  %post
      # Install necessary packages
      apt update && apt install -y python3-pip git
      pip3 install pytest
      useradd -m -s /bin/bash user
      mkdir -p /home/user/logs
      cat <<EOF > /home/user/logs/notes.txt
  apt-get install -y this-is-data-not-a-command
  EOF
      DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-confdef \\
          install -y --no-install-recommends jq=1.6-2 sqlite3
      chown -R user:user /home/user

  %files
      data/app.log /home/user/logs/app.log

  %environment
      export HOME=/home/user
      LANG="C.UTF-8"

  %runscript
      echo "ready"

  %labels
      Author someone
  """)


def write(folder, files):
  for name, content in files.items():
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
  return folder


def endless_terminals_folder(tmp_path, name="task_000001", **overrides):
  files = {
    "task.json": json.dumps({"description": "Count the ERROR lines.", "truth": "3",
                             "name": name}),
    "test_initial_state.py": "import os\n\ndef test_log():\n  assert os.path.exists('/home/user/logs/app.log')\n",
    "test_final_state.py": FINAL_TESTS,
    "container.def": CONTAINER_DEF,
    "data/app.log": "ERROR a\nERROR b\nINFO c\nERROR d\n",
  }
  files.update(overrides)
  return write(tmp_path / name, {k: v for k, v in files.items() if v is not None})


def bash_syntax_ok(script):
  return subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0


def test_endless_terminals_folder_translates_post_files_environment(tmp_path):
  task = load_task(str(endless_terminals_folder(tmp_path)))
  assert task.name == "task_000001"
  assert task.instruction == "Count the ERROR lines."
  assert task.final_tests == FINAL_TESTS
  assert "test_log" in task.initial_tests
  assert task.family == "endless-terminals"
  assert task.files == (("/home/user/logs/app.log", b"ERROR a\nERROR b\nINFO c\nERROR d\n"),)
  assert task.env == (("HOME", "/home/user"), ("LANG", "C.UTF-8"))
  # Package commands and creating the existing user became no-ops; the rest is kept verbatim.
  assert "apt install" not in task.setup and "pip3" not in task.setup
  assert "useradd" not in task.setup and "Dpkg::Options" not in task.setup
  assert "mkdir -p /home/user/logs" in task.setup
  assert "chown -R user:user /home/user" in task.setup
  # The here-document body is data, not a command: left untouched.
  assert "apt-get install -y this-is-data-not-a-command\nEOF\n" in task.setup
  assert "echo \"ready\"" not in task.setup  # %runscript is not part of the initial state
  assert task.solution is None
  assert bash_syntax_ok(task.setup)


def test_endless_terminals_solution_sh_is_the_oracle(tmp_path):
  folder = endless_terminals_folder(tmp_path, **{"solution.sh": "grep -c ERROR logs/app.log > report.txt\n"})
  assert load_task(str(folder)).solution == "grep -c ERROR logs/app.log > report.txt\n"


def test_missing_package_is_an_error_naming_the_line(tmp_path):
  bad = CONTAINER_DEF.replace("python3-pip git", "python3-pip postgresql")
  with pytest.raises(TaskLoadError, match=r"container.def line 6: .*needs postgresql"):
    load_task(str(endless_terminals_folder(tmp_path, **{"container.def": bad})))


@pytest.mark.parametrize("line, message", [
  ("pip install -r requirements.txt", "pip option -r cannot be translated"),
  ("pip3 install numpy==1.26", "needs python package\\(s\\) numpy"),
  ("apt-get remove -y git", "only apt install/update/clean"),
  ("apt-get install -y $(cat packages)", "computed package names"),
])
def test_untranslatable_package_lines(tmp_path, line, message):
  bad = CONTAINER_DEF.replace("    pip3 install pytest\n", f"    {line}\n")
  with pytest.raises(TaskLoadError, match=rf"container.def line 7: .*{message}"):
    load_task(str(endless_terminals_folder(tmp_path, **{"container.def": bad})))


def test_unknown_def_section_and_bad_environment_are_errors(tmp_path):
  bad = CONTAINER_DEF.replace("%runscript", "%setup")
  with pytest.raises(TaskLoadError, match=r"container.def line 24: section %setup"):
    load_task(str(endless_terminals_folder(tmp_path / "a", **{"container.def": bad})))
  bad = CONTAINER_DEF.replace('LANG="C.UTF-8"', "export PATH=/opt/bin:$PATH")
  with pytest.raises(TaskLoadError, match=r"container.def line 22: .*no expansions"):
    load_task(str(endless_terminals_folder(tmp_path / "b", **{"container.def": bad})))
  bad = CONTAINER_DEF.replace("data/app.log /home", "../../etc/passwd /home")
  with pytest.raises(TaskLoadError, match=r"container.def line 18: .*outside the task folder"):
    load_task(str(endless_terminals_folder(tmp_path / "c", **{"container.def": bad})))


def test_bad_metadata_and_tests_are_errors(tmp_path):
  with pytest.raises(TaskLoadError, match=r"task.json line 1: invalid JSON"):
    load_task(str(endless_terminals_folder(tmp_path / "a", **{"task.json": "{oops"})))
  with pytest.raises(TaskLoadError, match=r"needs a string field \"description\""):
    load_task(str(endless_terminals_folder(tmp_path / "b", **{"task.json": "{}"})))
  with pytest.raises(TaskLoadError, match=r"test_final_state.py line 2: imports numpy"):
    load_task(str(endless_terminals_folder(
      tmp_path / "c", **{"test_final_state.py": "import os\nimport numpy as np\n"})))
  with pytest.raises(TaskLoadError, match=r"test_final_state.py line 1: syntax error"):
    load_task(str(endless_terminals_folder(tmp_path / "d", **{"test_final_state.py": "def (:\n"})))
  with pytest.raises(TaskLoadError, match=r"missing test_final_state.py"):
    load_task(str(endless_terminals_folder(tmp_path / "e", **{"test_final_state.py": None})))


DOCKERFILE = textwrap.dedent("""\
  FROM ghcr.io/example/python-3-13:20250620
  WORKDIR /app
  # packages the image has
  RUN apt-get update && apt-get install -y \\
      # comment lines inside a continuation are dropped by docker too
      jq \\
      git && rm -rf /var/lib/apt/lists/*
  COPY data.csv /app/data.csv
  COPY inputs/ ./inputs/
  ENV PATH="/opt/tools/bin:$PATH"
  ENV A=1 B="two words"
  ENV LEGACY value with spaces
  RUN ["mkdir", "-p", "out"]
  CMD ["bash"]
  """)


def terminal_bench_folder(tmp_path, name="csv-sum", **overrides):
  files = {
    "task.yaml": textwrap.dedent("""\
      instruction: |
        Sum the second column of data.csv into out/sum.txt.
      difficulty: easy
      max_agent_timeout_sec: 360
      max_test_timeout_sec: 90
      """),
    "Dockerfile": DOCKERFILE,
    "data.csv": "a,1\nb,2\n",
    "inputs/x.txt": "x\n",
    "inputs/sub/y.txt": "y\n",
    "solution.sh": "awk -F, '{s+=$2} END {print s}' data.csv > out/sum.txt\n",
    "run-tests.sh": "pip install pytest && pytest $TEST_DIR/test_outputs.py\n",
    "tests/test_outputs.py": "def test_sum():\n  assert open('/app/out/sum.txt').read() == '3\\n'\n",
  }
  files.update(overrides)
  return write(tmp_path / name, {k: v for k, v in files.items() if v is not None})


def test_terminal_bench_yaml_folder(tmp_path):
  task = load_task(str(terminal_bench_folder(tmp_path)))
  assert task.name == "csv-sum" and task.family == "terminal-bench"
  assert task.instruction.startswith("(This task's working directory is /app.)")
  assert "Sum the second column" in task.instruction
  assert task.limits.episode_timeout_s == 360 and task.limits.test_timeout_s == 90
  assert dict(task.files) == {"/app/data.csv": b"a,1\nb,2\n", "/app/inputs/x.txt": b"x\n",
                              "/app/inputs/sub/y.txt": b"y\n"}
  assert task.env == (("PATH", f"/opt/tools/bin:{loaders.IMAGE_PATH}"), ("A", "1"),
                      ("B", "two words"), ("LEGACY", "value with spaces"))
  assert "apt-get" not in task.setup and "rm -rf /var/lib/apt/lists/*" in task.setup
  assert "mkdir -p /app" in task.setup and "mkdir -p out" in task.setup
  assert task.setup.rstrip().endswith("chown -R user:user /app")
  assert task.solution.startswith("cd /app\n")
  assert "def test_sum" in task.final_tests
  assert bash_syntax_ok(task.setup)


def test_harbor_toml_folder(tmp_path):
  folder = write(tmp_path / "hello", {
    "task.toml": "version = \"1.0\"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 30.0\n"
                 "[environment]\nmemory_mb = 1024\n",
    "instruction.md": "Write hello to /home/user/hello.txt\n",
    "environment/Dockerfile": "FROM debian\nRUN pip install pytest==8.3.4\n",
    "solution/solve.sh": "echo hello > /home/user/hello.txt\n",
    "tests/test.sh": "pytest /tests/test_state.py\n",
    "tests/test_state.py": "def test_hello():\n  assert open('/home/user/hello.txt').read() == 'hello\\n'\n",
  })
  task = load_task(str(folder))
  assert task.instruction == "Write hello to /home/user/hello.txt\n"
  assert task.limits.episode_timeout_s == 120 and task.limits.test_timeout_s == 30
  assert task.limits.memory_mb == 1024
  assert task.solution == "echo hello > /home/user/hello.txt\n"
  assert "pip" not in task.setup


@pytest.mark.parametrize("line, message", [
  ("COPY --from=builder /x /y", "cannot translate COPY"),
  ("ADD https://example.invalid/x.tgz /tmp/", "ADD from a URL"),
  ("ONBUILD RUN true", "cannot translate ONBUILD"),
  ("ENV X=$UNSET_THING", "refers to \\$UNSET_THING"),
  ("COPY missing.txt /app/", "missing.txt does not exist"),
  ("RUN apt-get install -y nginx", "needs nginx"),
])
def test_dockerfile_errors_name_the_line(tmp_path, line, message):
  folder = terminal_bench_folder(tmp_path, Dockerfile=f"FROM x\n{line}\n")
  with pytest.raises(TaskLoadError, match=rf"Dockerfile line 2: .*{message}"):
    load_task(str(folder))


def test_terminal_bench_needs_exactly_one_test_file(tmp_path):
  folder = terminal_bench_folder(tmp_path, **{"tests/test_more.py": "def test_x():\n  pass\n"})
  with pytest.raises(TaskLoadError, match=r"expected exactly one test_\*.py"):
    load_task(str(folder))
  with pytest.raises(TaskLoadError, match=r"task.yaml line 2: invalid YAML"):
    load_task(str(terminal_bench_folder(tmp_path / "b", **{"task.yaml": "instruction: [unclosed\n"})))


def test_load_tasks_sorted_and_errors(tmp_path):
  endless_terminals_folder(tmp_path, name="task_b")
  terminal_bench_folder(tmp_path, name="a-task")
  (tmp_path / "not-a-task").mkdir()
  assert [t.name for t in load_tasks(str(tmp_path))] == ["a-task", "task_b"]
  assert [t.name for t in load_tasks(str(tmp_path / "a-task"))] == ["a-task"]
  with pytest.raises(TaskLoadError, match="contains no task folders"):
    load_tasks(str(tmp_path / "not-a-task"))
  with pytest.raises(TaskLoadError, match="not a task folder"):
    load_task(str(tmp_path / "not-a-task"))


def test_translate_shell_keeps_non_package_commands():
  script = ("set -x\nfor f in a b; do echo $f; done\ngrep -c a <<< word\n"
            "apt-get -y update; echo done | tee x\n")
  out = translate_shell(script, "recipe")
  assert out.startswith("set -x\nfor f in a b; do echo $f; done\n")
  assert "apt-get" not in out and "echo done | tee x" in out
  assert bash_syntax_ok(out)


# The base image's mirror comes from apt's own configuration (jaxes/envs/images/base_image.py); parsing it
# needs no engine, so it is tested here beside the other recipe translation.

def test_image_reads_the_mirror_from_apt_sources(tmp_path):
  from jaxes.envs.images import base_image as image
  (tmp_path / "sources.list.d").mkdir()
  (tmp_path / "sources.list").write_text(
    "# comment\ndeb-src http://src.invalid/debian bookworm main\n"
    "deb [arch=amd64 signed-by=/k/one.gpg] http://one.invalid/debian bookworm-updates main\n")
  (tmp_path / "sources.list.d" / "debian.sources").write_text(
    "Types: deb\n# a comment\nURIs: http://two.invalid/debian\nSuites: bookworm bookworm-updates\n"
    "Components: main\nSigned-By: /k/two.gpg\n\n"
    "Types: deb\nURIs: http://sec.invalid/debian-security\nSuites: bookworm-security\n")
  (tmp_path / "sources.list.d" / "off.sources").write_text(
    "Types: deb\nEnabled: no\nURIs: http://off.invalid/debian\nSuites: bookworm\n")
  sources = image.apt_sources(str(tmp_path))
  assert [s.uri for s in sources] == ["http://one.invalid/debian", "http://two.invalid/debian",
                                      "http://sec.invalid/debian-security"]
  chosen = image.mirror_for("bookworm", sources)
  assert (chosen.uri, chosen.keyring) == ("http://two.invalid/debian", "/k/two.gpg")
  with pytest.raises(RuntimeError, match="serves suite 'trixie'"):
    image.mirror_for("trixie", sources)
  os_release = tmp_path / "os-release"
  os_release.write_text('NAME="Debian GNU/Linux"\nVERSION_CODENAME=bookworm\n')
  assert image.host_suite(str(os_release)) == "bookworm"


# -- hostile task folders: nothing outside the folder is ever read ------------------------------

def test_symlinks_out_of_the_task_folder_are_refused_naming_the_entry(tmp_path):
  secret = tmp_path / "host" / "shadow"
  secret.parent.mkdir()
  secret.write_text("root:$6$hash\n")
  et = endless_terminals_folder(tmp_path / "et")
  (et / "data" / "app.log").unlink()
  (et / "data" / "app.log").symlink_to(secret)            # %files data/app.log -> host file
  with pytest.raises(TaskLoadError, match=r"data/app.log leads outside the task folder"):
    load_task(str(et))
  tb = terminal_bench_folder(tmp_path / "tb")                # COPY inputs/ with a dir symlink
  (tb / "inputs" / "sub" / "rootdir").symlink_to(secret.parent, target_is_directory=True)
  with pytest.raises(TaskLoadError, match=r"inputs/sub/rootdir leads outside the task folder"):
    load_task(str(tb))
  meta = endless_terminals_folder(tmp_path / "meta")
  (meta / "test_final_state.py").unlink()
  (meta / "test_final_state.py").symlink_to(secret)
  with pytest.raises(TaskLoadError, match=r"test_final_state.py leads outside"):
    load_task(str(meta))


def test_symlinks_inside_the_folder_are_followed_and_loops_refused(tmp_path):
  tb = terminal_bench_folder(tmp_path / "tb")
  (tb / "inputs" / "alias.txt").symlink_to("x.txt")
  assert dict(load_task(str(tb)).files)["/app/inputs/alias.txt"] == b"x\n"
  (tb / "inputs" / "sub" / "up").symlink_to("..", target_is_directory=True)
  with pytest.raises(TaskLoadError, match="symlink loop"):
    load_task(str(tb))


def test_fifos_and_devices_are_refused(tmp_path):
  tb = terminal_bench_folder(tmp_path / "tb")
  os.mkfifo(tb / "inputs" / "pipe")                          # reading it would block forever
  with pytest.raises(TaskLoadError, match="inputs/pipe is a FIFO, not a regular file"):
    load_task(str(tb))
  if os.geteuid() == 0:
    (tb / "inputs" / "pipe").unlink()
    os.mknod(tb / "inputs" / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))   # /dev/zero
    with pytest.raises(TaskLoadError, match="inputs/zero is a character device"):
      load_task(str(tb))


def test_hard_links_are_refused_naming_the_entry(tmp_path):
  host_file = tmp_path / "host-secret"   # stands for a file of the host's outside the folder
  host_file.write_text("secret\n")
  tb = terminal_bench_folder(tmp_path / "tb")
  os.link(host_file, tb / "inputs" / "copy")
  with pytest.raises(TaskLoadError, match=r"inputs/copy is a hard link \(2 names\)"):
    load_task(str(tb))


@pytest.mark.parametrize("workdir", ["/usr/local", "/etc", "/opt/x", "/var/tmp", "/root",
                                     "/app/../usr/lib", "/home/other"])
def test_workdir_in_a_system_directory_is_refused(tmp_path, workdir):
  tb = terminal_bench_folder(tmp_path / "tb", Dockerfile=DOCKERFILE.replace("WORKDIR /app",
                                                                             f"WORKDIR {workdir}"))
  with pytest.raises(TaskLoadError, match=r"WORKDIR /\S+ is a system directory"):
    load_task(str(tb))


@pytest.mark.parametrize("workdir", ["/home/user/work", "/tmp/w", "/srvx"])
def test_workdir_in_the_agents_space_is_accepted(tmp_path, workdir):
  tb = terminal_bench_folder(tmp_path / "tb", Dockerfile=DOCKERFILE.replace("WORKDIR /app",
                                                                             f"WORKDIR {workdir}"))
  assert f"working directory is {workdir}" in load_task(str(tb)).instruction


def test_bytes_a_task_copies_in_are_capped(tmp_path):
  tb = terminal_bench_folder(tmp_path / "tb", **{"inputs/big.bin": "z" * 5000})
  with pytest.raises(TaskLoadError, match=r"big.bin \(5000 bytes\) would take the task past "
                                          r"its 4096-byte cap"):
    load_task(str(tb), max_bytes=4096)
  assert len(load_task(str(tb), max_bytes=loaders.MAX_TASK_BYTES).files) == 4


def test_non_utf8_task_json_names_the_file(tmp_path):
  folder = endless_terminals_folder(tmp_path)
  (folder / "task.json").write_bytes(b'{"description": "caf\xe9"}')
  with pytest.raises(TaskLoadError, match=r"task.json: not UTF-8 text \(byte 20"):
    load_task(str(folder))

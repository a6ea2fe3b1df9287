"""Task folders run as their authors wrote them (issue 35): each task's own image built by the
docker engine from tests/task_suites/ (Harbor and Endless Terminals folders, FROM
jaxes-sandbox:latest, nothing fetched), its own verifier, its own limits. The docker tests skip,
with the reason, when no engine or base image answers (`bash launch/docker/setup.sh`)."""
import dataclasses
import json
import os
import shutil
import uuid

import pytest

from jaxes.envs import check
from jaxes.envs.images import apptainer
from jaxes.envs.images.task_images import BuildContext, TaskImageBuilder, image_tag
from jaxes.envs.tasks import harbor, loaders
import helpers_repo

SUITE = str(helpers_repo.TASK_SUITES)
HARBOR, ENDLESS = "harbor-count-lines", "endless-error-count"


# -- without an engine ---------------------------------------------------------------------------

def test_the_context_hash_covers_paths_bytes_and_modes():
  base = BuildContext((("Dockerfile", b"FROM x\n", 0o644), ("run.sh", b"#!/bin/sh\n", 0o755)))
  changed = [BuildContext((("Dockerfile", b"FROM x\n", 0o644), ("run.sh", b"#!/bin/bash\n", 0o755))),
             BuildContext((("Dockerfile", b"FROM x\n", 0o644), ("run.sh", b"#!/bin/sh\n", 0o644))),
             BuildContext((("Dockerfile", b"FROM x\n", 0o644), ("go.sh", b"#!/bin/sh\n", 0o755))),
             BuildContext(base.files, dockerfile="other/Dockerfile")]
  reordered = BuildContext(tuple(reversed(base.files)))
  assert reordered.digest() == base.digest()
  assert len({base.digest()} | {c.digest() for c in changed}) == 5
  assert image_tag("My Task!", base).startswith("jaxes-task/my-task:")


def test_apptainer_definition_becomes_a_dockerfile():
  with open(os.path.join(SUITE, ENDLESS, "container.def")) as f:
    recipe = apptainer.parse(f.read(), "container.def")
  assert recipe.base == "jaxes-sandbox:latest"
  assert recipe.files[0][:2] == ("logs/app.log", "/home/user/logs/app.log")
  assert "mkdir -p /opt/logtools" in recipe.post
  assert apptainer.dockerfile(recipe).splitlines() == [
    "FROM jaxes-sandbox:latest", "COPY rootfs/ /", "COPY .jaxes/post.sh /tmp/jaxes-post.sh",
    "RUN cd / && /bin/sh -e /tmp/jaxes-post.sh && rm -f /tmp/jaxes-post.sh",
    'ENV LOG_DIR="/home/user/logs"']


@pytest.mark.parametrize("text, message", [
  ("Bootstrap: localimage\nFrom: base.sif\n", "Bootstrap: localimage cannot be built"),
  ("Bootstrap: docker\n", "no `From:`"),
  ("Bootstrap: docker\nFrom: x\n%setup\n  touch $APPTAINER_ROOTFS/x\n", "line 3: section %setup"),
  ("From: x\n%environment\n  A=$(id)\n", "line 3: cannot build %environment"),
])
def test_definitions_docker_cannot_build_are_refused_naming_the_line(text, message):
  with pytest.raises(apptainer.DefinitionError, match=message.replace("$", r"\$").replace("(", r"\(")):
    apptainer.parse(text, "container.def")


def test_harbor_reward_file_and_limits():
  assert harbor.parse_reward("1\n", None) == 1.0
  assert harbor.parse_reward(None, '{"reward": 0.5}') == 0.5
  # As Harbor: reward.json first; one without "reward" falls back to reward.txt.
  assert harbor.parse_reward("0", '{"reward": 1}') == 1.0
  assert harbor.parse_reward("1", '{"score": 0}') == 1.0
  for txt, js, message in [(None, None, "wrote no reward"), ("yes", None, "not a number"),
                           (None, "[1", "not JSON"), ("nan", None, "not finite"),
                           ("1", "", "not JSON"), (None, '{"score": 1}', "wrote no reward"),
                           ("1", "[1]", "not a JSON object"), ("1" * 5000, None, "larger than"),
                           ("1", "[" * 4096, "nested deeper than 32"),
                           ("1", '{"a": ' * 40 + "1" + "}" * 40, "nested deeper than 32")]:
    with pytest.raises(harbor.RewardError, match=message):
      harbor.parse_reward(txt, js)
  assert harbor.limits_from_toml(
    {"agent": {"timeout_sec": 60}, "environment": {"cpus": 2, "memory_mb": 512.0}}, "t") == {
      "episode_timeout_s": 60.0, "cpus": 2.0, "memory_mb": 512}
  with pytest.raises(ValueError, match="t: environment.memory_mb must be a positive number"):
    harbor.limits_from_toml({"environment": {"memory_mb": "2G"}}, "t")


def test_the_fixture_suites_still_load_translated():
  tasks = {t.name: t for t in loaders.load_tasks(SUITE)}
  assert all(t.image is None and not t.verifier_files for t in tasks.values())
  assert tasks[HARBOR].limits.memory_mb == 512 and tasks[HARBOR].limits.cpus == 0.5


# -- with the docker engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
  import docker
  return docker.from_env()


@pytest.fixture(scope="module")
def built(engine, tmp_path_factory):
  """The suite loaded as written: its two images built (or found cached) once for the module."""
  logs = str(tmp_path_factory.mktemp("build-logs"))
  builder = TaskImageBuilder(log_dir=logs, network="none")
  tasks = {t.name: t for t in loaders.load_tasks(SUITE, builder=builder)}
  return tasks, builder, logs


@pytest.fixture(scope="module")
def sandbox(engine):
  from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox
  sb = DockerSandbox(run_label=f"test-task-images-{uuid.uuid4().hex[:8]}")
  yield sb
  sb.shutdown()
  assert sb.leftovers() == {"containers": 0, "volumes": 0}


@pytest.mark.docker
def test_folders_load_with_their_own_images_and_the_cache_builds_nothing_twice(built, tmp_path):
  tasks, first, _ = built
  harbor_task, endless_task = tasks[HARBOR], tasks[ENDLESS]
  assert harbor_task.image.startswith("jaxes-task/harbor-count-lines:")
  assert harbor_task.workdir == "/app" and [p for p, _ in harbor_task.verifier_files] == [
    "test.sh", "test_outputs.py"]
  assert ("PATH", "/opt/tally/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
          ) in harbor_task.env
  assert endless_task.image.startswith("jaxes-task/endless-error-count:")
  assert ("LOG_DIR", "/home/user/logs") in endless_task.env and not endless_task.files
  again = TaskImageBuilder(log_dir=str(tmp_path), network="none")
  reloaded = {t.name: t for t in loaders.load_tasks(SUITE, builder=again)}
  assert [result.built for _, result in again.builds] == [False, False]
  assert {n: t.image for n, t in reloaded.items()} == {n: t.image for n, t in tasks.items()}
  assert os.listdir(tmp_path) == []    # nothing built, no build log written


@pytest.mark.docker
def test_check_runs_both_folders_oracle_passes_each_attempt_noop_fails(built, sandbox, capsys):
  code = check.main(["--backend", "docker", "--tasks", SUITE, "--agent", "oracle",
                     "--attempts", "2", "--no-progress"])
  lines = capsys.readouterr().out.strip().splitlines()
  summary = json.loads(lines[-1])
  assert code == 0, lines
  assert summary["tasks"] == 2 and summary["episodes"] == 4 and summary["passed"] == 4
  assert summary["pass_at_attempts"] == 1.0 and summary["leaked"] == 0
  rows = {line.split()[0]: line.split()[1:] for line in lines if line.startswith(("harbor", "endless"))}
  assert rows[HARBOR][:4] == ["2", "2", "1", "cached"]
  # noop on the Endless Terminals folder (Harbor's fails in the reward-file test below).
  results, leaked = check.run_checks(sandbox, [built[0][ENDLESS]], "noop", progress=False)
  assert check.summarize(results, leaked)["failures"] == {"FAILED_TESTS": 1} and leaked == 0


@pytest.mark.docker
def test_limits_from_task_toml_hold(built, sandbox, engine):
  task = built[0][HARBOR]
  assert (task.limits.episode_timeout_s, task.limits.test_timeout_s) == (120.0, 45.0)
  assert (task.limits.memory_mb, task.limits.cpus, task.limits.disk_mb) == (512, 0.5, 1024)
  # test.sh outliving the verifier's timeout is killed and fails the episode.
  slow = dataclasses.replace(
    task, limits=dataclasses.replace(task.limits, test_timeout_s=2.0),
    verifier_files=(("test.sh", b"echo 1 > /logs/verifier/reward.txt; sleep 30\n"),))
  with sandbox.start(slow) as handle:
    config = engine.containers.get(handle.container_id).attrs["HostConfig"]
    assert config["Memory"] == 512 << 20 and config["NanoCpus"] == 500_000_000
    assert handle.exec("tally /app/data.txt | grep -c keep", 10).output == "5\n"
    report = handle.run_tests()
  assert report.timed_out and not report.passed


@pytest.mark.docker
def test_the_harbor_verifier_sees_the_tests_only_after_the_agent_and_no_reward_it_left(built,
                                                                                     sandbox):
  task = built[0][HARBOR]
  with sandbox.start(task) as handle:
    seen = handle.exec("ls /tests 2>&1; ls -d /logs 2>&1; true", 10).output
    # A writer left running to plant a reward, and a reward file planted where the agent can.
    handle.exec("(while sleep 0.05; do echo 1 > /logs/verifier/reward.txt; done) "
                ">/dev/null 2>&1 & disown; echo 1 > /tmp/reward.txt", 10)
    report = handle.run_tests()
  assert "No such file" in seen
  assert not report.passed and "reward: 0" in report.report, report.report


@pytest.mark.docker
def test_a_task_images_env_reaches_the_agent_but_never_the_root_verifier(built, sandbox):
  endless = built[0][ENDLESS]
  probe = dataclasses.replace(endless, final_tests=(
    "import os\n\ndef test_scrubbed():\n  assert os.environ.get('LOG_DIR', '') == ''\n"))
  with sandbox.start(probe) as handle:
    assert handle.exec("echo $LOG_DIR", 10).output == "/home/user/logs\n"
    report = handle.run_tests()
  assert report.passed, report.report


@pytest.mark.docker
def test_a_failing_build_is_one_line_naming_the_step_and_keeps_its_log(built, tmp_path):
  folder = tmp_path / "broken"
  shutil.copytree(os.path.join(SUITE, HARBOR), folder)
  (folder / "environment" / "Dockerfile").write_text(
    "FROM jaxes-sandbox:latest\nRUN echo building && exit 3\n")
  builder = TaskImageBuilder(log_dir=str(tmp_path / "logs"), network="none")
  with pytest.raises(loaders.TaskLoadError) as err:
    loaders.load_task(str(folder), builder=builder)
  message = str(err.value)
  assert "\n" not in message and "task broken: image build failed at step 2/2 `RUN echo" in message
  assert "returned a non-zero code: 3" in message
  log_path = message.rsplit("build log: ", 1)[1].rstrip(")")
  with open(log_path) as f:
    assert "building" in f.read()


@pytest.mark.docker
def test_an_image_without_the_agents_user_gets_it_and_one_without_the_tools_is_refused(
    built, sandbox, engine, tmp_path):
  builder = TaskImageBuilder(log_dir=str(tmp_path / "logs"), network="none")
  for name, recipe in (("no-user", "RUN userdel -r user\n"),
                       ("no-setpriv", "RUN rm /usr/bin/setpriv\n")):
    folder = tmp_path / name
    shutil.copytree(os.path.join(SUITE, HARBOR), folder)
    dockerfile = (folder / "environment" / "Dockerfile")
    dockerfile.write_text(dockerfile.read_text() + recipe)
  task = loaders.load_task(str(tmp_path / "no-user"), builder=builder)   # a root-only image
  results, leaked = check.run_checks(sandbox, [task], "oracle", progress=False)
  assert results[0][1].passed and leaked == 0
  with pytest.raises(loaders.TaskLoadError, match="task no-setpriv: its image lacks what jaxes' "
                     r"agent protocol needs: util-linux \(setpriv\)"):
    loaders.load_task(str(tmp_path / "no-setpriv"), builder=builder)
  assert engine.images.list(name="jaxes-task/no-setpriv") == []   # never "cached"
  engine.images.remove(task.image)


@pytest.mark.docker
@pytest.mark.parametrize("attack", ["answer_key", "forged_verdict", "ptrace"])
def test_reward_hacking_replays_pass_nothing_on_a_task_built_image(built, sandbox, attack,
                                                                   tmp_path):
  from tests.envs.test_security import ATTACKS, replay_writing, shell_script_tasks
  image = built[0][ENDLESS].image
  tasks = [dataclasses.replace(t, image=image) for t in shell_script_tasks()[:1]]
  replay = tmp_path / "replay.json"
  replay.write_text(json.dumps(replay_writing(ATTACKS[attack][0], tasks)))
  results, leaked = check.run_checks(sandbox, tasks, f"replay:{replay}", progress=False)
  assert check.summarize(results, leaked)["failures"] == {"FAILED_TESTS": 1} and leaked == 0


def test_the_trainers_task_folders_kind_needs_docker_for_task_built_images():
  from jaxes.train import defaults
  from jaxes.envs import environments
  from jaxes.errors import ConfigError
  config = defaults.base_config()
  config.env.kind, config.env.task_dir, config.env.task_build = "task_folders", SUITE, "docker"
  with pytest.raises(ConfigError, match="env.task_build = 'docker' runs task-built images on the "
                     "docker sandbox only"):
    environments.environment(config).make_tasks(config, "train", 1, 0)


@pytest.mark.docker
def test_the_trainers_task_folders_kind_plays_task_built_images(built, sandbox):
  from jaxes.train import defaults
  from jaxes.envs import environments
  config = defaults.base_config()
  config.env.kind, config.env.task_dir, config.env.sandbox = "task_folders", SUITE, "docker"
  config.env.max_turns = 4
  env = environments.environment(config)
  tasks = env.make_tasks(config, "train", 3, 1)    # name order from 1, cycling
  assert [t.name for t in tasks] == [HARBOR, ENDLESS, HARBOR]
  assert tasks[0].image == built[0][HARBOR].image and tasks[0].limits.max_turns == 4
  make_episode = env.make_episode(config, env.default_system_prompt(config))
  task = tasks[1]
  with sandbox.start(task) as handle:   # the trainer's episode of the protocol, the oracle's turns
    episode = make_episode(task, handle)
    agent = check.make_agent("oracle")(task)
    while not episode.step(agent(episode.messages)):
      pass
    assert episode.finish().passed


@pytest.mark.docker
def test_an_endless_terminals_folder_with_a_dockerfile_instead_builds_it(built, tmp_path):
  folder = tmp_path / "et-dockerfile"
  shutil.copytree(os.path.join(SUITE, ENDLESS), folder)
  (folder / "container.def").unlink()
  (folder / "Dockerfile").write_text("FROM jaxes-sandbox:latest\nENV LOG_DIR=/var/log/et\n")
  builder = TaskImageBuilder(log_dir=str(tmp_path / "logs"), network="none")
  task = loaders.load_task(str(folder), builder=builder)
  assert task.image.startswith("jaxes-task/endless-error-count:") and task.image != (
    built[0][ENDLESS].image)
  assert ("LOG_DIR", "/var/log/et") in task.env
  builder.client.images.remove(task.image)


# -- a Harbor test.sh no file of the agent's can steer (issue 54) ------------------------------

# Terminal-Bench-2 style: fetch a tool (offline, nothing comes), source the env file its
# installer would write, run the tests.
TB2_STYLE_TEST_SH = b"""#!/bin/bash
curl -LsSf https://example.invalid/uv/install.sh 2>/dev/null | sh
source $HOME/.local/bin/env
if python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
# Each was a reward of 1 without solving (main at 9f5dcb2: test.sh ran as the agent's uid, with
# its HOME, in its working directory, writing a /logs/verifier it owned).
HARBOR_FORGERIES = {
  "pytest_shadowed_from_the_workdir": "printf 'raise SystemExit(0)\\n' > /app/pytest.py",
  "pth_in_the_user_site": 'd="$(python3 -m site --user-site)"; mkdir -p "$d" && '
                          'echo "import os; os._exit(0)" > "$d/zz_forge.pth"',
  "sourced_home_env_file": "mkdir -p ~/.local/bin && printf 'echo 1 > /logs/verifier/reward.txt; "
                           "chmod 444 /logs/verifier/reward.txt; exit 0\\n' > ~/.local/bin/env",
  "python3_on_an_agent_writable_path": "mkdir -p /app/bin && printf '#!/bin/sh\\nexit 0\\n' > "
                                       "/app/bin/python3 && chmod 755 /app/bin/python3",
}


@pytest.mark.docker
@pytest.mark.parametrize("agent", ["oracle", *HARBOR_FORGERIES])
def test_no_file_the_agent_leaves_steers_a_harbor_test_sh(built, sandbox, agent):
  task = built[0][HARBOR]
  env = tuple((k, "/app/bin:" + v if k == "PATH" else v) for k, v in task.env)
  task = dataclasses.replace(task, env=env, verifier_files=(
    ("test.sh", TB2_STYLE_TEST_SH), *[f for f in task.verifier_files if f[0] != "test.sh"]))
  with sandbox.start(task) as handle:
    command = task.solution if agent == "oracle" else HARBOR_FORGERIES[agent]
    assert handle.exec(command, 20).exit_code == 0
    report = handle.run_tests()
  assert report.passed == (agent == "oracle"), report.report


@pytest.mark.docker
def test_a_reward_file_that_cannot_be_read_fails_the_episode_and_counts(built, sandbox):
  task = built[0][HARBOR]
  unreadable = dataclasses.replace(task, verifier_files=(("test.sh", (
    "mkdir /logs/verifier/reward.txt\n"
    "python3 -c \"print('[' * 4096)\" > /logs/verifier/reward.json\n").encode()),))
  results, leaked = check.run_checks(sandbox, [unreadable], "oracle", progress=False)
  summary = check.summarize(results, leaked)
  assert summary["failures"] == {"FAILED_TESTS": 1} and summary["excluded"] == {}, summary


@pytest.mark.docker
def test_a_verifier_network_is_joined_only_for_test_sh_after_the_agent(built):
  from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox
  task = dataclasses.replace(built[0][HARBOR], verifier_files=(("test.sh", (
    b"ls /sys/class/net | grep -qv '^lo$' && echo 1 > /logs/verifier/reward.txt\n")),))
  online = DockerSandbox(run_label=f"test-verifier-network-{uuid.uuid4().hex[:8]}",
                         verifier_network="bridge")
  try:
    with online.start(task) as handle:
      assert handle.exec("ls /sys/class/net", 10).output.split() == ["lo"]
      report = handle.run_tests()
      assert handle.exec("ls /sys/class/net", 10).output.split() == ["lo"]
  finally:
    online.shutdown()
  assert report.passed, report.report


@pytest.mark.docker
def test_a_hostile_task_image_stays_contained(built, engine, tmp_path):
  """Its VOLUME leaves nothing on the host, its ENTRYPOINT never runs, its RUN steps get no
  network, and an image over the size cap is refused in one line."""
  from jaxes.envs.sandboxes.docker_sandbox import DockerSandbox
  folder = tmp_path / "hostile"
  shutil.copytree(os.path.join(SUITE, HARBOR), folder)
  dockerfile = folder / "environment" / "Dockerfile"
  dockerfile.write_text(dockerfile.read_text() + (
    "RUN ls /sys/class/net > /build-net\nVOLUME /data\n"
    'ENTRYPOINT ["/bin/sh", "-c", "touch /entry-ran; exec \\"$@\\"", "--"]\n'))
  builder = TaskImageBuilder(log_dir=str(tmp_path / "logs"))
  task = loaders.load_task(str(folder), builder=builder)
  sb = DockerSandbox(run_label=f"test-hostile-image-{uuid.uuid4().hex[:8]}")
  try:
    with sb.start(task) as handle:
      seen = handle.exec("cat /build-net; ls /entry-ran 2>&1; true", 10).output
    assert seen.splitlines()[:2] == ["lo", "ls: cannot access '/entry-ran': No such file or "
                                     "directory"], seen
    assert sb.leftovers() == {"containers": 0, "volumes": 0}
  finally:
    sb.shutdown()
  capped = TaskImageBuilder(log_dir=str(tmp_path / "logs"), max_image_mb=1)
  with pytest.raises(loaders.TaskLoadError) as err:
    loaders.load_task(str(folder), builder=capped)
  assert "\n" not in str(err.value) and "over the cap of 1 MiB" in str(err.value)
  assert engine.images.list(name="jaxes-task/hostile") == []

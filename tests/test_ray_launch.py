"""`launcher.kind = "ray"` (shared/launch/ray/launch.py): the roles run as processes of Ray actors on a real
Ray cluster, started here on 127.0.0.1 only (loopback: nothing listens beyond this machine).

The cluster is started once for the module with `ray start --head --block` in a session of its
own, and ended by killing that session (bounded; `ray stop` would stop every Ray on the machine).
What is checked: the default job (real vLLM actor, DeepSpeed learner) runs end to end with every
role the child of a Ray actor; the Ray worker that hosts the actor, SIGKILLed mid-run, is healed
(the launcher starts a new Ray actor in the same bundle and the learner re-attaches); nothing the
run started outlives it, and a role's child still stopping after the role exited gets its grace;
and a cluster that is not there, or cannot hold the run, is one clear line, exit status 2,
before any role starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MILLSTREAM, ROOT, check_accounting, start_run
from test_supervisor import ROLE_WITH_SLOW_CHILD, SLOW_CHILD

from millstream.shared.config import load_config
from millstream.shared.launch.ray.cluster import first_line, node_pins
from millstream.shared.process.lifecycle import run_processes, session_processes
from millstream.shared.process.runtime import free_port

RAY = str(Path(sys.executable).with_name("ray"))


class Cluster:
    def __init__(self, address: str, proc: subprocess.Popen) -> None:
        self.address, self.proc = address, proc

    def hosts(self) -> list[int]:
        """Live processes of the cluster that host a role (Ray workers of a RoleHost actor)."""
        return [pid for pid in session_processes(self.proc.pid) if _title(pid).startswith(b"ray::RoleHost")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # A short temp dir: Ray's unix sockets live under it and must stay under 108 bytes.
    temp = Path(tempfile.mkdtemp(prefix="msray-"))
    port = free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    log = temp / "start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"]
            + ["--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"]
            + [f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180  # about 12 s here; a minute on a loaded machine
        while b"Ray runtime started" not in log.read_bytes():
            assert proc.poll() is None, f"ray start failed:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start not ready in 180s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield Cluster(f"127.0.0.1:{port}", proc)
    finally:
        _end_session(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _end_session(proc: subprocess.Popen) -> None:
    """Every process of the cluster: SIGTERM, 3 s, then SIGKILL (Ray's own drain takes 30 s)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 3
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in session_processes(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _title(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def _pid(run_dir: Path, name: str) -> int:
    return int((run_dir / f"{name}.pid").read_text())


def _ends_clean(run_dir: Path, cluster: Cluster) -> None:
    """Nothing the run started is left: no role process, no Ray actor hosting one."""
    deadline = time.monotonic() + 20
    while (run_processes(run_dir) or cluster.hosts()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_processes(run_dir) == []
    assert cluster.hosts() == []


def _ray_run(cluster: Cluster, run_dir: Path, *overrides: str, until: str = "step ") -> subprocess.Popen:
    return start_run(
        run_dir,
        "launcher.kind=ray",
        f"launcher.ray_address={cluster.address}",
        *overrides,
        until=until,
    )


@pytest.mark.real
def test_the_default_job_runs_on_ray(cluster, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = _ray_run(cluster, run_dir, f"model.path={tiny_model_dir}", "train.steps=4", until="step    1/")
    # Every role is the child of a Ray worker of this cluster hosting a RoleHost actor.
    roles = ["actor", "learner", "envpool-0"]
    hosts = {name: _parent(_pid(run_dir, name)) for name in roles}
    assert all(_title(h).startswith(b"ray::RoleHost") for h in hosts.values()), hosts
    assert set(hosts.values()) <= set(session_processes(cluster.proc.pid))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "step    4/4" in out and "accounting ok" in out
    check_accounting(run_dir)
    _ends_clean(run_dir, cluster)


@pytest.mark.real  # the DeepSpeed learner
def test_a_killed_ray_worker_is_healed(cluster, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = _ray_run(
        cluster,
        run_dir,
        "actor.kind=synthetic",
        "actor.synthetic_step_s=0.01",
        f"model.path={tiny_model_dir}",
        "train.steps=30",
        "train.group_size=4",
        "train.groups_per_batch=2",
        "run.restart_backoff_s=0.2",
        until="step    3/",
    )
    actor = _pid(run_dir, "actor")
    host = _parent(actor)
    assert _title(host).startswith(b"ray::RoleHost")
    os.kill(host, signal.SIGKILL)  # the Ray worker; the actor sees its parent gone and stops
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "actor died (its Ray worker died" in out and "restarting it" in out
    assert _pid(run_dir, "actor") != actor
    log = (run_dir / "logs" / "learner.log").read_text()
    assert len(re.findall(r"weight group of 1 replicas \(actor\) at version \d+", log)) >= 2  # re-attached
    summary = check_accounting(run_dir)
    assert summary["open_groups"] == 0
    _ends_clean(run_dir, cluster)


#: A driver of its own (a Ray driver is a process for the run, not for pytest): starts the role
#: of tests/test_supervisor.py whose child takes half a second to stop, then stops it.
STOP_A_SLOW_ROLE = """
import sys, time
from pathlib import Path
from millstream.shared.config import load_config
from millstream.shared.launch.ray.launch import RaySupervisor
address, run_dir, elsewhere, role_child = sys.argv[1:5]
cfg = load_config(None, ["launcher.kind=ray", f"launcher.ray_address={address}"])
sup = RaySupervisor(cfg, Path(run_dir))
marker = Path(elsewhere) / "child-finished"
sup.start("role", "slow_role", [str(marker), role_child], env={"PYTHONPATH": elsewhere})
pid_file = Path(f"{marker}.pid")
deadline = time.monotonic() + 120
while not pid_file.exists() or not pid_file.read_text():
    assert not sup.exited() and time.monotonic() < deadline, sup.tail("role")
    time.sleep(0.05)
started = time.monotonic()
sup.stop(grace_s=10)
print(f"stopped in {time.monotonic() - started:.2f}s", flush=True)
"""


@pytest.mark.real
def test_stop_on_ray_lets_a_roles_children_finish_stopping(cluster, tmp_path):
    """`RaySupervisor.stop` stops each role's whole group on its node, as the local launcher
    does: a child still stopping after its role exited (vLLM's EngineCore) gets its grace, not a
    SIGKILL, and nothing of the run is alive when `stop` returns."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run_dir / "logs").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "slow_role.py").write_text(ROLE_WITH_SLOW_CHILD)
    driver = subprocess.run(
        [sys.executable, "-c", STOP_A_SLOW_ROLE, cluster.address, str(run_dir), str(elsewhere), SLOW_CHILD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert driver.returncode == 0, driver.stderr[-3000:]
    stopped_s = float(re.search(r"stopped in ([\d.]+)s", driver.stdout).group(1))
    assert (elsewhere / "child-finished").read_text() == "finished", "the child was killed mid-stop"
    assert stopped_s < 10  # it ended by itself, long before the grace ran out
    assert run_processes(run_dir) == []  # the child included, at once: `stop` waited for it
    _ends_clean(run_dir, cluster)


def test_a_cluster_that_cannot_hold_the_run_is_one_line(cluster, tiny_model_dir, tmp_path):
    proc = subprocess.run(
        [*MILLSTREAM, "run", "launcher.kind=ray", f"launcher.ray_address={cluster.address}"]
        + [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "launcher.actor_gpus=1"]
        + ["launcher.ray_start_timeout_s=15"],  # joining a loaded cluster takes seconds too
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "could not reserve the run's placement group in 15s" in line and "'GPU': 1.0" in line
    assert not list((tmp_path / "run").glob("*.pid")), "a role started"
    assert cluster.hosts() == []


def test_no_cluster_is_one_line_before_anything_starts(tiny_model_dir, tmp_path):
    port = free_port()  # nothing listens there
    proc = subprocess.run(
        [*MILLSTREAM, "run", "launcher.kind=ray", f"launcher.ray_address=127.0.0.1:{port}"]
        + [f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"millstream run: launcher.ray_address = '127.0.0.1:{port}': no Ray cluster answers there "
        "(Connection refused); start a cluster first, e.g. `ray start --head --node-ip-address "
        "127.0.0.1` (docs/multihost.md); the launcher never starts one"
    )
    assert not (tmp_path / "run").exists()


def test_roles_are_pinned_where_their_addresses_are():
    loopback = load_config(None, [])
    here = "10.0.0.9"
    assert node_pins(loopback, here) == {"actor": here, "learner": here, "envpool": here}
    spread = load_config(
        None,
        [
            "actor.address=tcp://10.0.0.1:5555",
            "learner.experience_address=tcp://10.0.0.2:5556",
            "learner.version_address=tcp://10.0.0.2:5557",
            "learner.sync_host=10.0.0.2",
        ],
    )
    assert node_pins(spread, "10.0.0.9") == {"actor": "10.0.0.1", "learner": "10.0.0.2", "envpool": None}


def test_the_multihost_example_is_a_valid_config():
    cfg = load_config(ROOT / "examples" / "multihost.toml")
    assert cfg.launcher.kind == "ray" and cfg.launcher.ray_address == "10.0.0.1:6379"
    assert node_pins(cfg, "10.0.0.1") == {"actor": "10.0.0.2", "learner": "10.0.0.1", "envpool": None}


def test_an_error_inside_a_ray_actor_is_told_by_its_cause():
    class TaskError(Exception):  # as ray.exceptions.RayTaskError carries it
        cause = FileNotFoundError("run directory /x is not on node n7")

    wrapped = TaskError("ray::RoleHost.start() (pid=1, ip=127.0.0.1)\n  File ...\nFileNotFoundError: ...")
    assert first_line(wrapped) == "FileNotFoundError: run directory /x is not on node n7"

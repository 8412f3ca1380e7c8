"""Where the launcher's roles run (shared/process/supervisor.py): each in a process group of its
own, all in the launcher's session, and found by `run_processes` through their group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from millstream.shared.process.lifecycle import run_processes
from millstream.shared.process.supervisor import Supervisor

#: A role that starts a child with an empty environment (as a process that sets its title hides
#: its environment from /proc), writes the child's pid, and waits.
ROLE = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={})
Path(sys.argv[1]).write_text(str(child.pid))
time.sleep(60)
"""


def test_roles_share_the_launchers_session_and_lead_their_own_group(tmp_path: Path):
    """One session for the run: Linux's autogroup scheduler shares the CPU between sessions
    first, and an actor in a session of its own kept the envpool waiting for a core for up to half
    a second while the engine computed. Signals still reach a role's whole group, and a child
    that hid its environment is found by its group, after its role died too."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run_dir / "logs").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "role_module.py").write_text(ROLE)
    child_file = elsewhere / "child"  # not a `*.pid` of the run directory
    sup = Supervisor(run_dir)
    sup.start("role", "role_module", [str(child_file)], env={"PYTHONPATH": str(elsewhere)})
    role = sup.procs["role"].pid
    try:
        deadline = time.monotonic() + 60
        while not child_file.exists() or not child_file.read_text():
            assert not sup.exited() and time.monotonic() < deadline, sup.tail("role")
            time.sleep(0.05)
        child = int(child_file.read_text())
        assert os.getsid(role) == os.getsid(0)  # the launcher's session
        assert os.getpgid(role) == role and os.getpgid(child) == role  # the role's own group
        found = run_processes(run_dir)
        assert role in found and child in found  # the child by its group: its environment is empty
        os.kill(role, signal.SIGKILL)  # the role dies; its child stays in its group
        sup.procs["role"].wait()
        assert run_processes(run_dir) == [child]
    finally:
        sup.stop(grace_s=5)
    deadline = time.monotonic() + 30
    while run_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run_processes(run_dir) == []


def test_a_live_process_that_took_a_roles_number_is_not_the_runs(tmp_path: Path):
    """A pid file outlives its role, and the number may be reused: a live process under it that
    does not carry the run's marker is not the run's, nor is its group or session."""
    (tmp_path / "logs").mkdir()
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], process_group=0, env={}
    )
    try:
        (tmp_path / "actor.pid").write_text(str(stranger.pid))
        assert run_processes(tmp_path) == []
    finally:
        stranger.kill()
        stranger.wait()


#: A role whose child takes its time to stop (as vLLM's EngineCore shuts down after its actor
#: has exited): on SIGTERM the role exits at once, the child half a second later, having
#: written that it finished.
SLOW_CHILD = """
import signal, sys, time
from pathlib import Path
def finish(*_):
    time.sleep(0.5)
    Path(sys.argv[1]).write_text("finished")
    sys.exit(0)
signal.signal(signal.SIGTERM, finish)
print("ready", flush=True)
time.sleep(60)
"""
ROLE_WITH_SLOW_CHILD = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], stdout=subprocess.PIPE)
child.stdout.readline()
Path(sys.argv[1] + ".pid").write_text(str(child.pid))
time.sleep(60)
"""


def test_stop_returns_when_a_roles_children_have_finished_stopping(tmp_path: Path):
    """`Supervisor.stop` waits for each role's whole group, not for the role alone: a child still
    stopping when its role has exited gets its grace (it is not SIGKILLed then), and nothing of
    the run is alive when `stop` returns. The launcher prints "every process stopped" then."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run_dir / "logs").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "slow_role.py").write_text(ROLE_WITH_SLOW_CHILD)
    marker = elsewhere / "child-finished"
    sup = Supervisor(run_dir)
    sup.start("role", "slow_role", [str(marker), SLOW_CHILD], env={"PYTHONPATH": str(elsewhere)})
    pid_file = Path(f"{marker}.pid")
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert not sup.exited() and time.monotonic() < deadline, sup.tail("role")
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert child in run_processes(run_dir)
    started = time.monotonic()
    sup.stop(grace_s=10)
    assert run_processes(run_dir) == []  # at once: no waiting loop after `stop`
    assert marker.read_text() == "finished"  # the child's own stop ran to its end
    assert time.monotonic() - started < 10  # it ended by itself, long before the grace ran out
    assert sup.procs["role"].returncode == -signal.SIGTERM


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)
#: Starts the above and exits at once, leaving it an orphan in the group.
LEAVES_AN_ORPHAN = (
    f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}]); "
    "print('ok', flush=True)"
)


def test_without_proc_a_group_still_reached_after_the_grace_is_killed(monkeypatch, tmp_path: Path):
    """Where there is no /proc (macOS), `stop_groups` cannot list a group's members: it asks the
    kernel whether a signal still reaches the group, and SIGKILLs it after the grace. (It read
    an empty /proc as "nobody left" and killed nothing.)"""
    from millstream.shared.process import lifecycle

    monkeypatch.setattr(lifecycle, "_PROC", tmp_path / "no-proc")
    proc = subprocess.Popen(
        [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True, process_group=0
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        started = time.monotonic()
        assert lifecycle.stop_groups([proc.pid], grace_s=0.5) == []
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert time.monotonic() - started >= 0.5  # SIGTERM first, and its grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reaped_leaders_empty_group_is_not_signalled_again(tmp_path: Path):
    """The number of a reaped leader whose group is empty may be given to a new process: it is
    no longer the caller's to signal (`live_group`), while a group with members left is."""
    from millstream.shared.process.lifecycle import group_processes, live_group

    proc = subprocess.Popen([sys.executable, "-c", "pass"], process_group=0)
    assert live_group(proc.pid, proc.returncode)  # not reaped yet: the caller's
    proc.wait(timeout=30)
    assert group_processes(proc.pid) == [] and not live_group(proc.pid, proc.returncode)
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LEAVES_AN_ORPHAN,
        ],
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    assert parent.stdout is not None
    parent.stdout.readline()
    parent.wait(timeout=30)
    try:
        deadline = time.monotonic() + 30
        while not group_processes(parent.pid):  # the orphan, still in the group
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert live_group(parent.pid, parent.returncode)  # reaped, but its orphan is left
    finally:
        os.killpg(parent.pid, signal.SIGKILL)

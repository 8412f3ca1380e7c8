"""Where the launcher's roles run (shared/process/supervisor.py): each in a process group of its
own, all in the launcher's session, and found by `run_processes` through their group."""

from __future__ import annotations

import os
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
    a second while the engine computed. Signals still reach a role's whole group."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "role_module.py").write_text(ROLE)
    child_file = tmp_path / "child.pid"
    sup = Supervisor(tmp_path)
    sup.start("role", "role_module", [str(child_file)], env={"PYTHONPATH": str(tmp_path)})
    role = sup.procs["role"].pid
    try:
        deadline = time.monotonic() + 60
        while not child_file.exists() or not child_file.read_text():
            assert time.monotonic() < deadline, sup.tail("role")
            time.sleep(0.05)
        child = int(child_file.read_text())
        assert os.getsid(role) == os.getsid(0)  # the launcher's session
        assert os.getpgid(role) == role and os.getpgid(child) == role  # the role's own group
        found = run_processes(tmp_path)
        assert role in found and child in found  # the child by its group: its environment is empty
    finally:
        sup.stop(grace_s=5)
    deadline = time.monotonic() + 30
    while run_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run_processes(tmp_path) == []

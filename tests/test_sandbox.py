"""pytool's sandbox against hostile code: the OS boundary holds with the audit hook switched off.

Every attack first removes the in-process hook (the two lines a policy needs: its globals are
the code's globals), and each escape is also run in the "weak" mode, where it must succeed:
that proves the strict failures come from the namespaces, not from the hook.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest

from millstream.envpool.envs import make_env
from millstream.envpool.envs.tools.sandbox.run import (
    CHILD,
    READY,
    mechanism_for,
    run_python,
    unavailable_message,
)

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0
BYPASSES = {
    "clear_lists": (
        "import sys\ng = sys.modules['__main__'].__dict__\n"
        "g['_BLOCKED_PREFIXES'] = ()\ng['_BLOCKED_EVENTS'] = frozenset()\n"
    ),
    "replace_hook": (
        "import sys\nhook = sys.modules['__main__'].__dict__['_audit']\n"
        "hook.__code__ = (lambda e, a: None).__code__\n"
    ),
}
BYPASS = BYPASSES["clear_lists"]


def run(code, mode="strict", **limits):
    return anyio.run(lambda: run_python(code, sandbox=mode, **limits), backend="trio")


def marked(marker):
    """Pids of live processes (anywhere on the machine) whose name is `marker`; a zombie (dead,
    waiting for a parent to reap it) is not live."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            state = (comm.parent / "stat").read_text().split(") ")[1][0]
            if comm.read_text().strip() == marker and state != "Z":
                found.append(int(comm.parent.name))
        except (OSError, IndexError):
            continue
    return found


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def forker(marker, count, then="print('forked', flush=True)"):
    """Code that forks `count` children which leave their session, name themselves and sleep."""
    return BYPASS + (
        "import os, time\n"
        f"for _ in range({count}):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        open('/proc/self/comm', 'w').write({marker!r})\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "time.sleep(0.5)\n"
        f"{then}\n"
    )


@pytest.mark.parametrize("bypass", sorted(BYPASSES))
def test_tcp_to_a_local_listener_fails_after_the_hook_is_removed(bypass):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = BYPASSES[bypass] + (
            "import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
        )
        assert run(code).output == "refused 101\n"  # ENETUNREACH: loopback is down, nothing else
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert run(code, "weak").output == "connected\n"  # the bypass is real


def test_udp_out_fails_after_the_hook_is_removed():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver:
        receiver.bind(("127.0.0.1", 0))
        receiver.settimeout(0.5)
        port = receiver.getsockname()[1]
        code = BYPASS + (
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"try:\n    s.sendto(b'forged', ('127.0.0.1', {port}))\n    print('sent')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
            "print(socket.if_nameindex())\n"
        )
        assert run(code).output == "refused 101\n[(1, 'lo')]\n"
        with pytest.raises(TimeoutError):
            receiver.recv(64)
        assert run(code, "weak").output.startswith("sent\n")
        assert receiver.recv(64) == b"forged"


@pytest.mark.slow
def test_forked_children_are_all_gone_when_the_call_returns():
    marker = f"sbxf{os.getpid() % 10**6}"
    code = forker(marker, 50, then="print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    result = run(code)
    assert result.output == "52\n"  # init, the worker and its 50 children, all alive at the end
    assert marked(marker) == []  # ... and killed with the namespace before run_python returned
    try:  # the weak mode's process-group kill misses children that left the group ...
        assert run(forker(marker, 3), "weak", cgroup="off").output == "forked\n"
        assert len(marked(marker)) == 3
    finally:
        kill_all(marked(marker))
    if not isinstance(_cgroups_here(), str):  # ... the call's cgroup does not
        assert run(forker(marker, 3), "weak").output == "forked\n"
        assert marked(marker) == []


def test_subprocesses_and_a_timeout_leave_nothing_behind():
    marker = f"sbxs{os.getpid() % 10**6}"
    spawn = (
        "import subprocess\n"
        "p = subprocess.Popen(['/bin/sh', '-c', 'sleep 60'], start_new_session=True)\n"
        "print('spawned', p.pid > 1, flush=True)\n"
    )
    code = forker(marker, 10, then=spawn + "while True: time.sleep(0.01)")
    result = run(code, timeout_s=1.5)
    assert result.status == "timeout" and result.output == "spawned True\n"
    deadline = time.monotonic() + 2  # the namespace dies as its killed init exits: a moment
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(marker) == []


def test_a_call_ends_with_its_caller_killed_mid_call():
    """An envpool worker killed (SIGKILL, OOM) in the middle of a call left the sandbox
    running: its supervisor, init and the code were handed to PID 1, for as long as the code
    liked. The supervisor now watches its caller and takes the namespace with it."""
    marker = f"sbxc{os.getpid() % 10**6}"
    code = forker(marker, 3, then="while True: time.sleep(0.01)")
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import anyio, sys\n"
            "from millstream.envpool.envs.tools.sandbox.run import run_python\n"
            "code = sys.stdin.read()\n"
            "anyio.run(lambda: run_python(code, sandbox='strict', timeout_s=600), backend='trio')\n",
        ],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        caller.stdin.write(code)
        caller.stdin.close()
        deadline = time.monotonic() + 30
        while len(marked(marker)) < 3 and time.monotonic() < deadline:  # the call is under way
            time.sleep(0.05)
        assert len(marked(marker)) == 3
    finally:
        caller.kill()
        caller.wait(10)
    deadline = time.monotonic() + 5
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = marked(marker)
    kill_all(left)
    assert left == []


def test_code_that_fakes_a_failed_setup_is_the_code_s_error():
    """A failed setup fails its episode as env_error (dropped, not scored): in the weak mode the
    code could print the setup's message and exit 125 itself, to have a wrong answer dropped
    rather than scored. What the code does after the child's READY is its own."""
    fake = "import os\nos.write(1, b'sandbox setup failed: x\\n')\nos._exit(125)\n"
    for mode in ("weak", "strict"):
        result = run(fake, mode)
        assert result.status == "error" and result.code_ran, (mode, result)
        assert result.output == "sandbox setup failed: x\n"


def test_no_writes_outside_the_working_directory(tmp_path):
    outside = [tmp_path / "escaped", REPO / "escaped-from-sandbox", Path("/escaped")]
    code = BYPASS + (
        f"for path in {[str(p) for p in outside]!r}:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('denied', e.errno)\n"
        "open('mine', 'w').write('ok')\nprint(open('mine').read())\n"
    )
    assert run(code).output == "denied 2\ndenied 2\ndenied 30\nok\n"  # not there, or read-only
    assert not any(p.exists() for p in outside)


def test_no_reads_of_keys_the_checkout_or_shadow(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    key = run_dir / "key.pem"
    key.write_text("secret")
    key.chmod(0o600)
    paths = [key, REPO / "pyproject.toml", Path("/etc/shadow"), Path("/etc/passwd"), Path.home() / ".bashrc"]
    code = BYPASS + (
        f"for path in {[str(p) for p in paths]!r}:\n"
        "    try:\n        print('read', path, open(path).read()[:10])\n"
        "    except OSError as e:\n        print('denied', e.errno)\n"
    )
    assert run(code).output == "denied 2\n" * len(paths)  # not mounted: no path leads there


@pytest.mark.skipif(not ROOT, reason="as a normal user the code keeps that user's uid")
def test_runs_as_nobody_without_capabilities_when_millstream_is_root():
    assert mechanism_for("strict") == "namespaces"
    code = BYPASS + (
        "import os\nprint(os.getresuid(), os.getresgid(), os.getgroups())\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapBnd'))])\n"
        "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])\n"
    )
    nobody = "(65534, 65534, 65534)"
    assert run(code).output == f"{nobody} {nobody} []\n{['0' * 16] * 2}\n1\n"


def test_the_old_checks_still_answer_honest_code_first():
    assert "network access is disabled in this sandbox" in run("import socket\nsocket.socket()").output
    assert (
        run("import os\nos.fork()").output == "line 2: PermissionError: os.fork is disabled in this sandbox\n"
    )
    assert run("import sys\nsys.exit(125)").returncode == 1  # 125 means a failed setup, never the code's


def test_an_unavailable_sandbox_is_refused_with_the_reason_and_the_opt_out():
    # A real failure, not a simulated one: as root "userns" is refused (it would keep uid 0);
    # as a normal user "namespaces" is (unshare without a user namespace needs CAP_SYS_ADMIN).
    missing = "userns" if ROOT else "namespaces"
    with pytest.raises(ValueError) as refused:
        make_env("pytool", {"sandbox": missing})
    message = str(refused.value)
    assert f"sandbox = {missing!r}: pytool cannot isolate the policy's code here" in message
    assert 'envpool.env_args = { sandbox = "weak" }' in message and "NOT a security boundary" in message
    with pytest.raises(ValueError, match="sandbox must be one of"):
        make_env("pytool", {"sandbox": "off"})
    weak = make_env("pytool", {"sandbox": "weak"})
    assert weak.mechanism == "none"
    text = unavailable_message("strict", "userns", "unshare(...): Operation not permitted")
    assert "user.max_user_namespaces" in text and "Operation not permitted" in text


def _as_nobody(mechanism, code):
    work = tempfile.mkdtemp(prefix="pytool-")  # pytest's tmp_path is private to root
    os.chown(work, 65534, 65534)
    # The sandbox's child script and the modules beside it that it imports, where nobody can
    # read them: a checkout may sit in a folder private to root (a `mktemp -d` clone is 0700).
    for source in CHILD.parent.glob("*.py"):
        os.chmod(shutil.copy(source, work), 0o644)
    child = os.path.join(work, CHILD.name)
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
    command += ["-I", "-S", child, str(256 * 2**20), "5", str(2**20), mechanism, str(4 * 2**20)]
    try:
        done = subprocess.run(command, input=code.encode(), capture_output=True, cwd=work, timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return done.returncode, (done.stdout.removeprefix(READY) + done.stderr).decode()


@pytest.mark.skipif(
    not (ROOT and shutil.which("setpriv") and os.path.exists("/usr/bin/python3")),
    reason="needs root (to become nobody), setpriv and a system python nobody may run",
)
def test_userns_holds_for_a_normal_user():
    """The "userns" mechanism, as an unprivileged user (nobody): the same guarantees."""
    marker = f"sbxu{os.getpid() % 10**6}"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = forker(marker, 10, then="") + (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
            f"for path in [{str(REPO / 'pyproject.toml')!r}, '/etc/passwd']:\n"
            "    try:\n        open(path).read()\n        print('read')\n"
            "    except OSError as e:\n        print('denied', e.errno)\n"
            "try:\n    open('/usr/escaped', 'w')\nexcept OSError as e:\n    print('denied', e.errno)\n"
            "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
            "print(os.getuid(), caps)\n"
        )
        status, output = _as_nobody("userns", code)
    assert (status, output) == (0, f"refused 101\ndenied 2\ndenied 2\ndenied 30\n65534 {['0' * 16]}\n")
    assert marked(marker) == []
    # the root-only mechanism really is unavailable to this user: the refusal's honest case
    status, output = _as_nobody("namespaces", "print('ran')")
    assert (status, output) == (
        125,
        "sandbox setup failed: unshare(mount, pid, net, ipc, uts, cgroup): Operation not permitted\n",
    )


KERNEL_PROBE = BYPASS + (
    "import ctypes, os, subprocess, threading\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def attempt(name, *args):\n"
    "    done = getattr(libc, name)(*args)\n"
    "    print(name, 'errno', ctypes.get_errno()) if done == -1 else print(name, 'allowed')\n"
    # clone(CLONE_NEWUSER | SIGCHLD) first: after an unshare(CLONE_NEWUSER) that worked, the
    # next would fail for want of a uid map, with or without the filter.
    "pid = libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0)\n"
    "if pid == 0:\n    os._exit(0)\n"  # the clone itself, if it was made: gone at once
    "print('clone', 'errno', ctypes.get_errno()) if pid == -1 else print('clone', os.waitpid(pid, 0)[1])\n"
    "attempt('unshare', 0x10000000)\n"  # CLONE_NEWUSER: be root in a namespace of its own
    "attempt('unshare', 0x00020000 | 0x40000000)\n"  # mount and network namespaces
    "attempt('mount', b'none', b'/tmp', b'tmpfs', 0, None)\n"
    "attempt('syscall', {bpf}, 0, 0, 0)\n"
    "attempt('syscall', {keyctl}, 0, 0, 0)\n"
    "attempt('syscall', {perf}, 0, 0, 0, 0, 0)\n"
    "attempt('syscall', {clone3}, 0, 0)\n"  # ENOSYS: glibc falls back to clone, which is checked
    "attempt('socket', 30, 2, 0)\n"  # AF_TIPC: loads its module on first use
    "attempt('socket', 40, 1, 0)\n"  # AF_VSOCK
    "import socket; socket.socket(socket.AF_INET6).close(); socket.socketpair()\n"  # these work
    "t = threading.Thread(target=print, args=('a thread',)); t.start(); t.join()\n"
    "print(subprocess.run(['/bin/echo', 'a subprocess'], capture_output=True, text=True).stdout.strip())\n"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')])\n"
)
SYSCALLS = {  # the numbers the probe calls by hand
    "x86_64": {"clone": 56, "bpf": 321, "keyctl": 250, "perf": 298, "clone3": 435},
    "aarch64": {"clone": 220, "bpf": 280, "keyctl": 219, "perf": 241, "clone3": 435},
}


@pytest.mark.skipif(
    os.uname().machine not in SYSCALLS, reason="the probe knows x86_64's and aarch64's numbers"
)
def test_kernel_interfaces_are_denied_after_the_hook_is_removed():
    """issue 27: jailed code could unshare(CLONE_NEWUSER), be root in it and mount; the filter
    denies it, and threads and subprocesses still work (clone3's ENOSYS makes glibc use clone)."""
    code = KERNEL_PROBE.format(**SYSCALLS[os.uname().machine])
    eperm = ["clone", "unshare", "unshare", "mount", "syscall", "syscall", "syscall"]
    expected = [f"{name} errno 1" for name in eperm] + ["syscall errno 38"] + ["socket errno 97"] * 2
    expected += ["a thread", "a subprocess", "['2']"]
    assert run(code).output.splitlines() == expected
    # The same calls reach the kernel without the filter: the weak mode (root, no jail) clones
    # into a user namespace and makes one. Only those are compared: the others' answers
    # depend on privileges.
    assert run(code, "weak").output.splitlines()[:2] == ["clone 0", "unshare allowed"]


def _memory_hog(children, child_mb, parent_mb=0):
    """Code that forks `children` processes holding `child_mb` MiB each, then holds `parent_mb`."""
    return BYPASS + (
        "import os, time\n"
        "def hold(mb):\n"
        "    block = bytearray(mb * 2**20)\n"
        "    for i in range(0, len(block), 4096):\n"
        "        block[i] = 1\n"
        "    return block\n"
        "kids = []\n"
        f"for _ in range({children}):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        held = hold({child_mb})\n"
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "time.sleep(0.3)\n"
        f"mine = hold({parent_mb})\n"
        "print('killed', sum(os.waitpid(k, 0)[1] & 0x7F == 9 for k in kids), flush=True)\n"
    )


def _cgroups_here():
    from millstream.envpool.envs.tools.sandbox import cgroups

    return cgroups.find_cgroups("auto")


needs_cgroup = pytest.mark.skipif(
    isinstance(_cgroups_here(), str), reason="this process cannot make cgroups here (see find_cgroups)"
)


@needs_cgroup
@pytest.mark.slow  # many processes filling memory for seconds: `make test`, not test-fast
@pytest.mark.parametrize("mode", ["strict", "weak"])
def test_a_call_s_processes_together_stay_under_memory_mb(mode):
    """issue 27: RLIMIT_AS held each process, so 17 of them reached 1,330 MiB in one call.
    Here 6 children of 60 MiB each stay under a 128 MiB address space; together they cannot."""
    code = _memory_hog(6, 60)
    result = run(code, mode, memory_mb=128, timeout_s=20)
    killed = int(result.output.split()[-1])
    assert result.status == "ok" and killed >= 4  # at most two of 60 MiB fit in 128 together
    assert result.memory_peak_bytes is not None and result.memory_peak_bytes <= 128 * 2**20
    # Without the call's cgroup every child fits its own limit and none is killed.
    alone = run(code, mode, memory_mb=128, timeout_s=20, cgroup="off")
    assert (alone.output, alone.memory_peak_bytes) == ("killed 0\n", None)


@needs_cgroup
def test_the_call_killed_for_memory_says_so():
    # Two children of 40 MiB, then the code itself takes 80: it is the largest, the kernel
    # picks it, and the call reports the cgroup's ceiling, not a bare signal.
    result = run(_memory_hog(2, 40, parent_mb=80), memory_mb=128, timeout_s=20)
    assert (result.status, result.output) == ("memory_limit", "")
    env = make_env("pytool", {"memory_mb": 128})
    assert "its processes together went over 128 MB" in env._show(result)


@needs_cgroup
@pytest.mark.slow  # a fork bomb and a busy loop held for seconds: `make test`, not test-fast
def test_forks_stop_at_max_processes_and_the_cpu_at_cpus():
    fork_all = BYPASS + (
        "import os, time\nmade = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1)\n"
        "            os._exit(0)\n"
        "        made += 1\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print(made)\n"
    )
    # 16 for the code, its own process included: 15 more (the jail's two do not count).
    assert run(fork_all, max_processes=16).output == "refused 11\n15\n"
    # The weak mode has no jail: the code gets them too (it cannot count on the slack).
    assert run(fork_all, "weak", max_processes=16).output == "refused 11\n17\n"
    spin = BYPASS + (
        "import os, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        start = time.monotonic()\n"
        "        while time.monotonic() - start < 1:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "os.wait(); os.wait()\n"
        "print(round(os.times().children_user + os.times().children_system, 1))\n"
    )
    # Two busy processes for a second of wall time each, under half a CPU: about half a
    # second of CPU between them (without the ceiling, up to two on two idle cores).
    assert float(run(spin, cpus=0.5, timeout_s=20).output) <= 0.7


@needs_cgroup
def test_no_cgroup_is_left_behind(tmp_path):
    from millstream.envpool.envs.tools.sandbox import cgroups

    found = cgroups.find_cgroups("auto")
    assert isinstance(found, cgroups.CallCgroups)
    parents = set(found.parents.values())
    run(forker(f"sbxc{os.getpid() % 10**6}", 3, then="time.sleep(30)"), timeout_s=1)  # a timeout
    run("print(1)")
    assert all(list(parent.glob("call-*")) == [] for parent in parents)


def test_an_unusable_cgroup_path_is_refused_and_a_missing_cgroup_is_one_line(tmp_path, caplog):
    with pytest.raises(ValueError, match="is not a cgroup v2 directory"):
        make_env("pytool", {"cgroup": str(tmp_path)})
    with pytest.raises(ValueError, match='cgroup must be "auto", "off"'):
        make_env("pytool", {"cgroup": "memory"})
    with pytest.raises(ValueError, match="max_processes must be an integer >= 2"):
        make_env("pytool", {"max_processes": 1})
    from millstream.envpool.envs.tools.sandbox.run import missing_limits

    assert missing_limits("none", "off") is None  # switched off on purpose: nothing to say
    line = missing_limits(mechanism_for("strict"), "auto")
    if isinstance(_cgroups_here(), str):
        assert line is not None and "no per-call cgroup" in line
    else:
        assert line is None  # this machine: v1 cgroups and a filter, nothing missing


def test_code_killed_by_sigkill_is_reported_as_killed():
    # The jail's supervisor passes the worker's end on as its own; for SIGKILL it raised
    # (signal(SIGKILL, SIG_DFL) is EINVAL) and the call came back as an error with a traceback.
    result = run("import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (result.status, result.returncode, result.output) == ("killed", -9, "before\n")


def test_a_child_that_does_not_exit_after_sigkill_is_left_behind_after_a_bound(monkeypatch):
    """A killed child stuck in the kernel (a frozen cgroup, a hung mount) must not hold its
    episode and its slot for good: the reap outlives the episode's deadline (shielded) but gives
    up after REAP_S. No signal makes such a child here, so a stand-in whose exit never comes
    plays it."""
    from millstream.envpool.envs.tools.sandbox import run as sandbox_run

    monkeypatch.setattr(sandbox_run, "REAP_S", 0.3)

    class StuckInKernel:
        stdin = stdout = stderr = None

        async def wait(self) -> int:
            await anyio.sleep_forever()
            return 0

    async def reap() -> float:
        started = anyio.current_time()
        with anyio.move_on_after(0.01):  # the episode's deadline passes at once
            await sandbox_run._reap(StuckInKernel())  # type: ignore[arg-type]
        return anyio.current_time() - started

    assert 0.3 <= anyio.run(reap, backend="trio") < 5


@needs_cgroup
def test_a_killed_process_s_cgroups_are_swept_by_the_next(tmp_path):
    from millstream.envpool.envs.tools.sandbox import cgroups

    found = cgroups.find_cgroups("auto")
    assert isinstance(found, cgroups.CallCgroups)
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # a pid no process can have
    left = [parent.parent / f"millstream-sandbox-{dead}" for parent in found.parents.values()]
    for folder in left:
        (folder / "call-3").mkdir(parents=True)
    assert isinstance(cgroups._find("auto"), cgroups.CallCgroups)  # as a new process would
    assert not any(folder.exists() for folder in left)


def _run_filter(program, arch, nr, arg0=0):
    """What a classic BPF seccomp program answers for one call (the subset the filter uses)."""
    data = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF}
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld [k]
            accumulator = data[k]
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: bool(accumulator & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "riscv64"])
def test_the_filter_answers_every_call_as_written(machine):
    """The BPF program itself, for every architecture it is written for (only this machine's
    is ever loaded here): each denied call, clone's flags, sockets' families, foreign entries."""
    from millstream.envpool.envs.tools.sandbox.syscall_filter import ARCHES, DENIED, SOCKET_FAMILIES, program

    arch, numbers = ARCHES[machine]
    code = program(machine)
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050001, 0x00050026
    for name in DENIED:
        if name in numbers:
            assert _run_filter(code, arch, numbers[name]) == eperm, name
    assert _run_filter(code, arch, numbers["clone3"]) == enosys
    assert _run_filter(code, arch, numbers["clone"], 0x10000000 | 17) == eperm  # CLONE_NEWUSER
    assert _run_filter(code, arch, numbers["clone"], 0x00020000) == eperm  # CLONE_NEWNS
    assert _run_filter(code, arch, numbers["clone"], 0x003D0F00) == allow  # a thread's flags
    assert _run_filter(code, arch, numbers["clone"], 17) == allow  # fork
    for family in SOCKET_FAMILIES:
        assert _run_filter(code, arch, numbers["socket"], family) == allow
    for family in (30, 40, 21):  # TIPC, vsock, RDS
        assert _run_filter(code, arch, numbers["socketpair"], family) == 0x00050061
    assert _run_filter(code, arch, 0) == allow and _run_filter(code, arch, 1) == allow
    assert _run_filter(code, 0x40000003, 0) == kill  # i386's entry (or arm's): other numbers
    if machine == "x86_64":
        assert _run_filter(code, arch, 0x40000000 | 1) == eperm  # the x32 entry
    assert len(code) < 256 and set(DENIED) >= {"unshare", "setns", "mount", "ptrace", "bpf", "keyctl"}


def test_a_thread_pool_fits_in_the_sandbox():
    """Under the address-space limit each thread's own malloc arena (64 MiB reserved) left room
    for 3 or 4 threads: a 16-thread pool failed with "can't start new thread". One arena now."""
    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(16) as pool:\n"
        "    print(sum(pool.map(lambda i: sum(range(i * 1000)), range(64))))\n"
    )
    result = run(code)
    assert result.status == "ok" and result.output == f"{sum(sum(range(i * 1000)) for i in range(64))}\n", (
        result
    )


@needs_cgroup
@pytest.mark.skipif(not ROOT, reason="the nobody user's count is the namespaces mechanism's (root)")
def test_with_the_call_s_cgroup_the_nobody_user_s_count_is_not_shared():
    """Every sandbox runs as nobody: a per-user process limit is every call's on the machine,
    and one call's fork bomb took the processes and threads of the others' honest code. With
    the call's own pids cgroup bounding it, no such limit is set; without one, it is."""
    code = "import resource\nprint(resource.getrlimit(resource.RLIMIT_NPROC)[0])\n"
    assert run(code).output.strip() != "512"
    assert run(code, cgroup="off").output.strip() == "512"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="modify_ldt is x86's")
def test_the_ldt_is_not_the_code_s_to_change():
    """modify_ldt (x86's local descriptor table, a past source of kernel exploits; Docker's
    default profile denies it) answered 0 in the jail; the filter now denies it."""
    code = BYPASS + (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(16)\n"
        "print(libc.syscall(154, 0, buf, 16), ctypes.get_errno())\n"
    )
    assert run(code).output.split() == ["-1", "1"]  # EPERM


@pytest.mark.skipif(
    not (ROOT and shutil.which("unshare")), reason="needs root and unshare(1) for a PID 1 caller"
)
def test_a_caller_that_is_pid_1_keeps_its_sandbox():
    """A container's entrypoint is PID 1: the supervisor took a parent of PID 1 for its caller's
    death and ended every call, so the sandbox probe failed ("needs CAP_SYS_ADMIN", wrongly).
    The caller's pid is now run.py's own."""
    script = (
        "import anyio, os\n"
        "from millstream.envpool.envs.tools.sandbox.run import run_python\n"
        "print(os.getpid(), anyio.run(lambda: run_python(\"print('hi')\"), backend='trio').output.strip())\n"
    )
    done = subprocess.run(
        ["unshare", "-pf", "--mount-proc", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["1", "hi"], done.stdout + done.stderr

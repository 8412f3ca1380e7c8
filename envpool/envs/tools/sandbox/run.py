"""Run Python the policy wrote, in a sandbox that holds when the code is hostile.

pytool runs code written by the model being trained. That code is adversarial by construction:
if it can reach the network, the run's files or a process that outlives it, the policy can learn
to forge its own reward. So the boundary is the operating system's, not Python's:

    python -I -S child.py MEMORY CPU FILE MECHANISM WORK_BYTES CGROUP_PROCS  < code

`child.py` reads the code, then `jail.py` locks it in (read those two for the
mechanics) before a single line of it runs. `sandbox` picks how:

- "strict" (the default): the best real isolation this user can get, else refuse to start.
  As root that is "namespaces", as any other user "userns";
- "namespaces": new mount, PID, network, IPC and UTS namespaces, made as root; the code runs as
  uid/gid 65534 (nobody) with no capabilities and no_new_privs;
- "userns": the same namespaces inside an unprivileged user namespace that maps the user to
  itself; the code keeps the user's uid but holds no capability, even in that namespace;
- "weak": no namespaces; rlimits, a PEP 578 audit hook and a process-group kill only, as
  before. Code can switch the hook off in two lines: for code you trust, never for training.

What the two real mechanisms guarantee, however the code behaves:
- no network: a fresh network namespace with only loopback, down, and no capability to change
  that (the audit hook's message says so first, for honest code);
- no files of the host: the code sees a read-only root holding /usr, the /lib directories, the
  interpreter's stdlib, a few devices and a fresh /proc; the only writable place is its working
  directory, a tmpfs of `4 * file_mb` MiB that vanishes with it. The checkout, /root, /home,
  /etc and the run directory with its keys are not mounted at all (not merely unreadable);
- nothing outlives the call: the code runs as PID 2 of its own PID namespace, whose PID 1 exits
  when it does (and dies with the supervisor on a timeout): the kernel then kills every process
  left in the namespace, whatever it did with sessions or process groups;
- no kernel interface it has no use for: a seccomp filter (syscall_filter.py) denies namespaces,
  mounts, ptrace, bpf, perf events, io_uring, keyrings and the like, so the code cannot make a
  user namespace and be root in it, the usual first step of a container escape;
- the limits of the weak mode still apply: address space, CPU seconds, file size, open files,
  the parent's wall clock and output cap; as nobody also RLIMIT_NPROC, against fork bombs.

In every mode, where the machine lets this process make cgroups (cgroups.py; `cgroup = "auto"`),
each call runs in its own: its processes together get `memory_mb` of memory (the working
directory's files included), `max_processes` processes and `cpus` CPUs. Where there is no
cgroup or no filter, pytool says so in one line at preflight and runs on (`missing_limits`).

Availability is probed once per process and mechanism (one sandboxed `print`, ~30 ms) and
cached. pytool's constructor asks for it, so `millstream run`'s preflight refuses a run that
cannot be isolated, with the reason and the opt-out, before anything expensive starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import Process
from anyio.lowlevel import RunVar

from millstream.envpool.envs.tools.sandbox.cgroups import (
    CallCgroup,
    CallCgroups,
    Ceiling,
    Usage,
    find_cgroups,
)
from millstream.envpool.envs.tools.sandbox.syscall_filter import ARCHES

__all__ = [
    "SANDBOX_MODES",
    "RunResult",
    "SandboxError",
    "SandboxUnavailable",
    "check_cgroup",
    "mechanism_for",
    "missing_limits",
    "run_python",
    "unavailable_message",
]

log = logging.getLogger(__name__)

CHILD = Path(__file__).resolve().with_name("child.py")
#: The child's whole environment, with the caller's pid (MILLSTREAM_SANDBOX_CALLER: the jail
#: ends the call if this process dies first). One malloc arena: under the address-space limit each thread's
#: own arena (64 MiB reserved) left room for 3 or 4 threads of a thread pool, not `max_processes`.
CHILD_ENV = {"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "1"}


def _child_env() -> dict[str, str]:
    return {**CHILD_ENV, "MILLSTREAM_SANDBOX_CALLER": str(os.getpid())}


SANDBOX_MODES = ("strict", "namespaces", "userns", "weak")
SETUP_FAILED = 125  # the supervisor's exit status for a failed setup (see jail.py)
#: What child.py writes first once its setup is done (before any of the code runs).
READY = b"\x00ready\n"
#: Longest wait for a killed child to exit before it is left behind (see `_reap`).
REAP_S = 10.0
# "ok" and the number of seccomp filters on the jailed code ("?" without /proc). With ours it
# is one more than this process has (a container's own filter counts on both sides).
_PROBE_CODE = (
    "try:\n    n = open('/proc/self/status').read().split('Seccomp_filters:')[1].split()[0]\n"
    "except Exception:\n    n = '?'\nprint('ok', n)\n"
)
_PROBES: dict[str, str | None] = {}  # mechanism -> why it failed, or None when it works
_FILTERED: dict[str, bool] = {}  # mechanism -> whether the probe ran under our filter
_WARNED_WEAK: list[bool] = []


class SandboxError(RuntimeError):
    """The sandbox could not be set up for one run (not the code's fault: never scored)."""


class SandboxUnavailable(RuntimeError):
    """No real isolation is available for the requested sandbox mode on this machine."""


@dataclass(frozen=True)
class RunResult:
    output: str  #: stdout and stderr together, decoded, at most max_output_bytes of them
    #: "ok", "error" (nonzero exit), "timeout", "cpu_limit", "memory_limit" (the call's cgroup
    #: ceiling: the kernel killed one of its processes), "truncated", "killed"
    status: str
    returncode: int | None
    memory_peak_bytes: int | None = None  #: the call's processes together, where a cgroup held it
    #: The setup was done and the code started (child.py's READY came first).
    code_ran: bool = True


async def _reap(process: Process) -> None:
    """Wait for the (killed) child and close its pipes: shielded, so that the episode's own
    deadline does not leave it unreaped, but bounded by `REAP_S`, so that a child stuck in the
    kernel after SIGKILL (a frozen cgroup, a hung mount) does not hold the episode and its slot
    for good. (anyio's `Process.aclose` waits for the exit without a bound, even when
    cancelled.)"""
    with anyio.CancelScope(shield=True):
        with anyio.move_on_after(REAP_S):
            await process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                await stream.aclose()


def _command(
    memory_mb: int,
    cpu_s: int,
    file_mb: int,
    mechanism: str,
    join: list[str] | None = None,
) -> list[str]:
    """The child's command line (its docstring's usage)."""
    limits = [str(memory_mb * 2**20), str(cpu_s), str(file_mb * 2**20), mechanism, str(4 * file_mb * 2**20)]
    return [sys.executable, "-I", "-S", str(CHILD), *limits, ",".join(join or [])]


def _probe(mechanism: str) -> str | None:
    """Why `mechanism` does not work here (one line), or None: a real sandboxed run, once."""
    if mechanism not in _PROBES:
        workdir = tempfile.mkdtemp(prefix="pytool-probe-")
        try:
            done = subprocess.run(
                _command(64, 5, 1, mechanism),
                input=_PROBE_CODE.encode(),
                capture_output=True,
                cwd=workdir,
                env=_child_env(),
                timeout=30,
            )
            out = (done.stdout.removeprefix(READY) + done.stderr).decode("utf-8", "replace").strip()
            ok = done.returncode == 0 and out.startswith("ok ")
            _PROBES[mechanism] = None if ok else (out.splitlines() or [f"exit status {done.returncode}"])[-1]
            _FILTERED[mechanism] = ok and out.split()[-1] == str(_filters_here() + 1)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _PROBES[mechanism] = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return _PROBES[mechanism]


def unavailable_message(sandbox: str, mechanism: str, reason: str) -> str:
    """The refusal: what failed, why it matters, how to fix it, and the explicit opt-out."""
    if "running as root" in reason:
        fix = 'as root use sandbox = "strict" or "namespaces" (the code then runs as nobody)'
    elif mechanism == "namespaces":
        fix = (
            "as root this needs CAP_SYS_ADMIN for unshare(2) (a container started with "
            "--cap-add SYS_ADMIN, or without a seccomp profile that forbids unshare)"
        )
    else:
        fix = (
            "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone = 1 on Debian kernels, "
            "kernel.apparmor_restrict_unprivileged_userns = 0 on Ubuntu 24.04+)"
        )
    return (
        f"sandbox = {sandbox!r}: pytool cannot isolate the policy's code here: the {mechanism!r} "
        f"sandbox failed ({reason}). Without it the code the policy writes gets your user's "
        f"network, files and processes, and could forge its own reward. To fix: {fix}. To run "
        'anyway with code you trust: envpool.env_args = { sandbox = "weak" } (an audit hook and '
        "rlimits, NOT a security boundary)."
    )


def mechanism_for(sandbox: str) -> str:
    """The mechanism `sandbox` runs with here ("namespaces", "userns", "none"), probed once;
    SandboxUnavailable with the refusal message when it cannot be had."""
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {', '.join(map(repr, SANDBOX_MODES))}, got {sandbox!r}")
    if sandbox == "weak":
        if not _WARNED_WEAK:
            _WARNED_WEAK.append(True)
            log.warning("pytool: sandbox = 'weak': the policy's code is NOT isolated from this machine")
        return "none"
    mechanism = sandbox if sandbox != "strict" else "namespaces" if os.geteuid() == 0 else "userns"
    reason = _probe(mechanism)
    if reason is not None:
        raise SandboxUnavailable(unavailable_message(sandbox, mechanism, reason))
    return mechanism


def check_cgroup(cgroup: str) -> None:
    """ValueError naming the problem unless `cgroup` is "auto", "off" or a cgroup v2 directory
    this process can use: a path the operator named is refused when unusable, never ignored."""
    if cgroup in ("auto", "off"):
        return
    if not isinstance(cgroup, str) or not os.path.isabs(cgroup):
        raise ValueError(f'cgroup must be "auto", "off" or an absolute cgroup v2 path, got {cgroup!r}')
    found = find_cgroups(cgroup)
    if isinstance(found, str):
        raise ValueError(f"cgroup = {cgroup!r} cannot hold the sandbox's calls: {found}")


def _filters_here() -> int:
    """The seccomp filters on this process (Seccomp_filters: Linux 5.9+; else -1)."""
    try:
        return int(Path("/proc/self/status").read_text().split("Seccomp_filters:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return -1


def missing_limits(mechanism: str, cgroup: str = "auto") -> str | None:
    """What the sandbox lacks on this machine beyond the mechanism itself, one line, or None:
    no seccomp filter in the jail, no per-call cgroup. pytool logs it at preflight."""
    missing = []
    if mechanism != "none" and _probe(mechanism) is None and not _FILTERED.get(mechanism):
        machine = os.uname().machine
        why = f"no syscall numbers for {machine}" if machine not in ARCHES else "the kernel took none"
        missing.append(f"no seccomp filter ({why}): jailed code can reach unshare, mount, bpf and the like")
    found = find_cgroups(cgroup)
    if isinstance(found, str) and cgroup != "off":
        missing.append(f"no per-call cgroup ({found}): memory_mb holds each process of a call, not the call")
    return "; ".join(missing) or None


# Per event loop (a limiter belongs to the loop it was made in), per limit.
_LIMITERS: RunVar[dict[int, anyio.CapacityLimiter]] = RunVar("pytool_sandbox_limiters")


def _limiter(total: int) -> anyio.CapacityLimiter:
    limiters = _LIMITERS.get(None)
    if limiters is None:
        limiters = {}
        _LIMITERS.set(limiters)
    if total not in limiters:
        limiters[total] = anyio.CapacityLimiter(total)
    return limiters[total]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 5,
    memory_mb: int = 256,
    file_mb: int = 1,
    max_output_bytes: int = 16384,
    max_concurrent: int = 8,
    sandbox: str = "strict",
    max_processes: int = 64,
    cpus: float = 1.0,
    cgroup: str = "auto",
) -> RunResult:
    """Run `code` in the sandbox described in the module docstring and collect its output.

    Raises SandboxUnavailable when `sandbox` cannot be had here (probed once, before any
    code runs), and SandboxError when the setup of this one run failed."""
    mechanism = mechanism_for(sandbox)
    found = find_cgroups(cgroup)
    ceiling = Ceiling(memory_mb * 2**20, max_processes, cpus)
    async with _limiter(max_concurrent):
        workdir = tempfile.mkdtemp(prefix="pytool-")
        try:
            group = _open_cgroup(found, ceiling) if isinstance(found, CallCgroups) else None
            join = group.join_files if group is not None else None
            command = _command(memory_mb, cpu_s, file_mb, mechanism, join)
            try:
                result = await _run_in(workdir, command, code, timeout_s, max_output_bytes)
            finally:
                usage = await _close_cgroup(group) if group is not None else None
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    # A failed setup ends with 125 before the child's READY; code that exits 125 itself (in the
    # weak mode: a jail maps the code's 125 to 1) came after it, and is the code's own status.
    if result.returncode == SETUP_FAILED and not result.code_ran:
        raise SandboxError(result.output.strip() or "sandbox setup failed")
    if usage is None:
        return result
    ceiling_killed = usage.at_ceiling and usage.oom_kills and result.status in ("killed", "error")
    status = "memory_limit" if ceiling_killed else result.status
    return RunResult(result.output, status, result.returncode, usage.memory_peak_bytes, result.code_ran)


async def _close_cgroup(group: CallCgroup) -> Usage:
    """Read what the call used, then remove its cgroup (shielded: a cancelled call's too)."""
    with anyio.CancelScope(shield=True):
        usage = group.usage()
        # After a kill the namespace may still be dying: then wait for it, off the event loop.
        if not group.remove(timeout_s=0) and not await anyio.to_thread.run_sync(group.remove):
            log.warning("pytool: the call's cgroup %s would not go", group.join_files)
    return usage


def _open_cgroup(found: CallCgroups, ceiling: Ceiling) -> CallCgroup:
    try:
        return found.open(ceiling)
    except OSError as exc:  # the machine's fault, not the code's: never scored
        raise SandboxError(f"sandbox setup failed: the call's cgroup in {found.where}: {exc}") from None


async def _run_in(
    workdir: str, command: list[str], code: str, timeout_s: float, max_output_bytes: int
) -> RunResult:
    process = await anyio.open_process(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=workdir,
        env=_child_env(),
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None
    output = bytearray()
    truncated = False
    max_output_bytes += len(READY)  # the marker is not the code's output
    try:
        with anyio.move_on_after(timeout_s) as deadline:
            try:
                await process.stdin.send(code.encode("utf-8", "replace"))
                await process.stdin.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the child died before reading: its exit status tells why
            async for chunk in process.stdout:
                output += chunk[: max_output_bytes - len(output)]
                if len(output) >= max_output_bytes:
                    truncated = True
                    break
            if not truncated:
                await process.wait()
    finally:
        if process.returncode is None:
            # The weak mode's child leads its session: this kills it and what it started. In a
            # jail it kills the supervisor, whose death (PDEATHSIG) ends the PID namespace.
            _kill_group(process.pid)
        await _reap(process)
    ran = output.startswith(READY)
    text = output[len(READY) if ran else 0 :].decode("utf-8", "replace")
    returncode = process.returncode
    if returncode is None:
        log.warning("sandboxed process %d did not exit %.0fs after SIGKILL: left behind", process.pid, REAP_S)
        return RunResult(text, "killed", None, code_ran=ran)
    if deadline.cancelled_caught:
        return RunResult(text, "timeout", returncode, code_ran=ran)
    if truncated:
        return RunResult(text, "truncated", returncode, code_ran=ran)
    if returncode == -signal.SIGXCPU:
        return RunResult(text, "cpu_limit", returncode, code_ran=ran)
    if returncode is not None and returncode < 0:
        return RunResult(text, "killed", returncode, code_ran=ran)
    return RunResult(text, "ok" if returncode == 0 else "error", returncode, code_ran=ran)

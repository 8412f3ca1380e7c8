"""The sandbox that runs policy-written Python (`pytool` and friends).

run.py             `run_python`: one call in a fresh child, with limits; which mechanism is usable
child.py           the child process (run by path): joins its cgroup, reads the code, locks itself in, runs it
jail.py            the lock: namespaces, a private read-only root, no network, rlimits (stdlib only)
syscall_filter.py  the seccomp filter jail.py installs last (stdlib only)
cgroups.py         one cgroup per call: the memory, processes and CPU of all its processes together
"""

from millstream.envpool.envs.tools.sandbox.run import (
    SANDBOX_MODES,
    RunResult,
    SandboxError,
    SandboxUnavailable,
    check_cgroup,
    mechanism_for,
    missing_limits,
    run_python,
    unavailable_message,
)

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

"""The sandbox that runs policy-written Python (`pytool` and friends).

run.py     `run_python`: one call in a fresh child, with limits; which mechanism is usable
child.py   the child process (run by path): reads the code, locks itself in, runs it
jail.py    the lock: namespaces, a private read-only root, no network, rlimits (stdlib only)
"""

from millstream.envpool.envs.tools.sandbox.run import (
    SANDBOX_MODES,
    RunResult,
    SandboxError,
    SandboxUnavailable,
    mechanism_for,
    run_python,
    unavailable_message,
)

__all__ = [
    "SANDBOX_MODES",
    "RunResult",
    "SandboxError",
    "SandboxUnavailable",
    "mechanism_for",
    "run_python",
    "unavailable_message",
]

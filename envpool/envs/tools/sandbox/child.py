"""The child side of pytool's sandbox: limit this process, then run the code read from stdin.

    python -I -S child.py MEMORY_BYTES CPU_SECONDS FILE_BYTES MECHANISM [WORK_BYTES [CGROUP_PROCS]] < code

Run by envpool/envs/tools/sandbox/run.py, never imported by it (stdlib only, nothing from millstream: with
`-I -S` neither the repository nor site-packages is on the path; the siblings it needs,
jail.py and syscall_filter.py, are imported by path before any user code exists). In order:

0. join the call's cgroup (CGROUP_PROCS: its cgroup.procs files, comma-separated; see
   cgroups.py), before anything forks, so that every process of the call is counted in it;
   read the whole code from stdin; then, unless MECHANISM is "none" (pytool's weak mode), lock
   this process in with jail.enter: new namespaces, a private read-only root, no
   network, no privileges. That is the security boundary; everything below runs inside it;
1. resource limits: address space (a big allocation raises MemoryError), CPU seconds (SIGXCPU
   kills a busy loop even if the parent's wall-clock timer were late), size of written files,
   at most 64 open files, no core dumps;
   and, inside the jail's "namespaces" mechanism (uid nobody) without the call's cgroup, at most
   NPROC_NOBODY processes of that user, which bounds a fork bomb (with it, pids.max does);
2. give the code an empty stdin (`input()` sees EOF) and no other inherited descriptor;
3. an audit hook (PEP 578) refuses socket events, process creation and loading native libraries
   with ctypes, with a clear message. It is a first line of defence against honest mistakes
   only: code in the same interpreter can remove it (its globals are the code's globals). What
   holds against hostile code is step 0;
4. run the code as `__main__` with stderr joined to stdout (one ordered stream); an uncaught
   exception prints one line, `line N: Type: message`, not a full traceback (short observations).
"""

import io
import os
import resource
import sys

SETUP_FAILED = 125  # as jail.py: run.py raises SandboxError on it
#: Written first once the setup is done, before any of the code runs: run.py takes an exit
#: status of SETUP_FAILED for a failed setup only without it (weak mode's code could exit 125
#: and print a setup failure of its own, to have its episode dropped rather than scored).
READY = b"\x00ready\n"
NPROC_NOBODY = 512  # shared by all sandboxes of the machine: they all run as the same nobody

_BLOCKED_PREFIXES = ("socket.",)
_BLOCKED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
    }
)


def _audit(event, args):
    if event.startswith(_BLOCKED_PREFIXES):
        raise PermissionError("network access is disabled in this sandbox")
    if event in _BLOCKED_EVENTS:
        raise PermissionError(f"{event} is disabled in this sandbox")


def _limit(kind, value, hard=None):
    try:
        resource.setrlimit(kind, (value, value if hard is None else hard))
    except (ValueError, OSError):  # a hard limit already lower than ours: keep the lower one
        pass


def _jail(mechanism, work_bytes, caller):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import jail  # type: ignore[import-not-found]  # sibling files, found by path
        import syscall_filter  # type: ignore[import-not-found]
    finally:
        del sys.path[0]  # so the jail does not bind the checkout's directory into the sandbox
    jail.enter(mechanism, os.getcwd(), work_bytes, syscall_filter.install, caller)


def _join(procs_files):
    for path in procs_files.split(","):
        try:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            os.write(1, f"sandbox setup failed: join the call's cgroup {path}: {exc.strerror}\n".encode())
            os._exit(SETUP_FAILED)


def main():
    memory, cpu, file_size = (int(a) for a in sys.argv[1:4])
    mechanism = sys.argv[4] if len(sys.argv) > 4 else "none"
    joined = len(sys.argv) > 6 and bool(sys.argv[6])
    if joined:
        _join(sys.argv[6])
    code = sys.stdin.read()
    if mechanism != "none":
        caller = os.environ.get("MILLSTREAM_SANDBOX_CALLER")  # run.py's pid: the call ends with it
        _jail(mechanism, int(sys.argv[5]), int(caller) if caller else None)
        # Without the call's cgroup (its pids.max bounds this call alone), the nobody user's
        # count bounds a fork bomb. Not with it: that count is every sandbox's on the machine,
        # and one call's bomb would take the processes and threads of the others' honest code.
        # (A normal user's count includes the trainer's own threads: not for "userns".)
        if mechanism == "namespaces" and not joined:
            _limit(resource.RLIMIT_NPROC, NPROC_NOBODY)
    os.closerange(3, 65536)
    _limit(resource.RLIMIT_AS, memory)
    # Soft limit: SIGXCPU (the parent reports "CPU limit"); the hard one, a second later, SIGKILL
    # for code that catches SIGXCPU. Equal limits would send SIGKILL straight away.
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_FSIZE, file_size)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 64)
    os.write(1, READY)
    sys.stdin = io.StringIO()
    sys.stderr = sys.stdout
    try:
        compiled = compile(code, "<python>", "exec")
    except SyntaxError as exc:
        where = f"line {exc.lineno}: " if exc.lineno else ""
        print(f"{where}SyntaxError: {exc.msg}")
        return 1
    except ValueError as exc:  # null bytes in the source, before Python 3.11.4
        print(f"SyntaxError: {exc}")
        return 1
    sys.addaudithook(_audit)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compiled, namespace)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException as exc:
        tb, line = exc.__traceback__, None
        while tb is not None:  # the innermost frame of the user's code
            if tb.tb_frame.f_code.co_filename == "<python>":
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f"line {line}: " if line is not None else ""
        message = str(exc)
        print(f"{where}{type(exc).__name__}{': ' + message if message else ''}")
        return 1
    return 0


def _quick_exit(status):
    """End like sys.exit, minus the interpreter's teardown: a forked interpreter (the jail's
    worker) that frees every object copies its whole heap page by page first, ~10 ms a run."""
    import atexit

    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()  # wait for the code's non-daemon threads, as sys.exit does
    atexit._run_exitfuncs()
    sys.stdout.flush()
    os._exit(status if isinstance(status, int) else 1)


if __name__ == "__main__":
    status = main()
    if status == SETUP_FAILED:  # the code's own 125 must not read as a failed setup
        status = 1
    sys.stdout.flush()
    if len(sys.argv) > 4 and sys.argv[4] != "none":
        _quick_exit(status)
    sys.exit(status)

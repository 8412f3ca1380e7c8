"""The child side of pytool's sandbox: limit this process, then run the code read from stdin.

    python -I -S _sandbox_child.py MEMORY_BYTES CPU_SECONDS FILE_BYTES  < code

Run by envpool/envs/pytool.py, never imported by it (stdlib only, nothing from millstream: with
`-I -S` neither the repository nor site-packages is on the path). In order:

1. resource limits: address space (a big allocation raises MemoryError), CPU seconds (SIGXCPU
   kills a busy loop even if the parent's wall-clock timer were late), size of written files,
   at most 64 open files, no core dumps;
2. read the whole code from stdin, then give the code an empty stdin (`input()` sees EOF);
3. an audit hook (PEP 578) refuses socket events, process creation and loading native libraries
   with ctypes. This is a best-effort guard against honest mistakes and casual misuse, NOT a
   security boundary: code can still reach the OS in ways the hook does not see. Untrusted code
   needs an OS sandbox (namespaces, seccomp, a container or a VM) around this process;
4. run the code as `__main__` with stderr joined to stdout (one ordered stream); an uncaught
   exception prints one line, `line N: Type: message`, not a full traceback (short observations).
"""

import io
import resource
import sys

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


def main():
    memory, cpu, file_size = (int(a) for a in sys.argv[1:4])
    _limit(resource.RLIMIT_AS, memory)
    # Soft limit: SIGXCPU (the parent reports "CPU limit"); the hard one, a second later, SIGKILL
    # for code that catches SIGXCPU. Equal limits would send SIGKILL straight away.
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_FSIZE, file_size)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 64)
    code = sys.stdin.read()
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


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.exit(status)

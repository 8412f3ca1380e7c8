"""The OS boundary around pytool's sandbox: namespaces, a private root, no privileges.

Imported by child.py before it reads any user code (stdlib and ctypes only, like the
child). `enter(mechanism, workdir, work_bytes)` returns in a process that is locked in; the
processes it leaves behind to watch never return from it. The shape:

    supervisor (the process pytool started; outside the new PID namespace)
      └─ init (PID 1 of a new PID namespace: builds the root, waits, reports)
           └─ worker (PID 2: drops its privileges, then returns to run the code)

Why three processes: a PID namespace applies to the *children* of whoever creates it, and the
kernel kills every process in it when its PID 1 exits. So the code never runs as PID 1 (PID 1
ignores signals it has no handler for, SIGXCPU included, which would break the CPU limit), and
init exits as soon as the worker does: nothing the code forked, daemonized or re-grouped can
outlive the call. init also dies with the supervisor (PR_SET_PDEATHSIG), so the parent's kill
of the supervisor on a timeout takes the whole namespace with it, and the supervisor kills init
when its own caller dies (an envpool worker killed mid-call). The supervisor turns the
worker's wait status into its own (same exit code, same signal), so pytool reads it as before.

Two mechanisms, picked by pytool (see sandbox/run.py):
- "namespaces" (run as root): new mount, PID, network, IPC and UTS namespaces; the worker then
  becomes uid/gid 65534 (nobody) with no supplementary groups, an empty capability bounding
  set and no_new_privs, so nothing it runs can become root again;
- "userns" (run as a normal user): the same namespaces inside a new user namespace that maps the
  user to itself; the worker drops every capability it holds in that namespace (bounding set,
  ambient and the capability sets themselves), so it cannot undo the mounts below.

Either way the worker's last step is the seccomp filter of syscall_filter.py (no namespaces,
mounts, ptrace, bpf and the like from here on), which no_new_privs lets it install unprivileged.

Either way the network namespace has only a loopback device, down, and no way to configure it;
and the worker sees a new root: a read-only tmpfs holding read-only binds of /usr, the /lib
and /bin directories (or their symlinks), the interpreter's own stdlib directories, a few
devices (/dev/null, zero, full, random, urandom), a fresh /proc of the new PID namespace, and
its working directory, a small tmpfs (the only writable place, gone with the namespace). The
host's old root is detached after pivot_root, so the checkout, /root, /home, /etc, the run
directory and its keys are not reachable by any path.

A failed step raises nowhere near user code: it is reported to the supervisor, which prints
`sandbox setup failed: <step>: <reason>` and exits with SETUP_FAILED (pytool raises on it, and
maps a user's own exit status 125 to 1 so the two cannot be confused).
"""

import _signal  # type: ignore[import-not-found]  # the C module: `signal` imports enum (~5 ms a run)
import ctypes
import os
import resource
import select
import sys

SETUP_FAILED = 125
NOBODY = 65534

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWCGROUP = 0x02000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux >= 5.12)
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 1
# What the interpreter and the extension modules it may load need; nothing private lives here.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the sandbox's setup failed; the message names the step and the reason."""


def _check(result, step):
    if result == -1:
        errno = ctypes.get_errno()
        raise SetupError(f"{step}: {os.strerror(errno)}")
    return result


def _enc(text):
    return text.encode() if text is not None else None


def _mount(source, target, fstype, flags, data=None):
    enc = _enc
    step = f"mount {fstype or 'bind'} {source or ''} on {target}".replace("  ", " ")
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), step)


def _write(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise SetupError(f"write {path}: {exc.strerror}") from None


def enter(mechanism, workdir, work_bytes, filter_syscalls, caller=None):
    """Lock this process in; return only in the worker (see the module docstring).

    `caller` is the pid of the process the call is for (the envpool worker): the supervisor
    ends the call if it dies first. None: not watched.

    `filter_syscalls` is syscall_filter.install (child.py imports both by path): called last in
    the worker, it may return why no filter went on (reported at preflight) or raise."""
    uid, gid = os.getuid(), os.getgid()
    if mechanism == "userns" and uid == 0:
        _fail_now("userns: running as root; use the namespaces mechanism (it drops to nobody)")
    report_r, report_w = os.pipe()  # init and worker -> supervisor: failures, the final status
    alive_r, alive_w = os.pipe()  # held open by the supervisor: EOF tells init it is gone
    # A cgroup namespace too: the call's cgroup (joined before this) is its root, so the code
    # does not see the host's cgroup paths.
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP
    try:
        if mechanism == "userns":
            _check(_libc.unshare(flags | _CLONE_NEWUSER), "unshare(user, mount, pid, net, ipc, uts, cgroup)")
            # An unprivileged user may map itself, and only after refusing setgroups(2).
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        elif mechanism == "namespaces":
            _check(_libc.unshare(flags), "unshare(mount, pid, net, ipc, uts, cgroup)")
        else:
            raise SetupError(f"unknown mechanism {mechanism!r}")
    except SetupError as exc:
        _fail_now(str(exc))
    init = os.fork()
    if init:
        os.close(report_w)
        os.close(alive_r)
        _supervise(init, report_r, caller)  # never returns
    try:
        os.close(report_r)
        os.close(alive_w)
        _check(_libc.prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if select.select([alive_r], [], [], 0)[0]:  # the supervisor died before PDEATHSIG was set
            os._exit(1)
        to_uid, to_gid = (NOBODY, NOBODY) if mechanism == "namespaces" else (uid, gid)
        _new_root(workdir, work_bytes, to_uid, to_gid)
        worker = os.fork()
        if worker:
            _init(worker, report_w)  # never returns
        _drop_privileges(mechanism, to_uid, to_gid)
        filter_syscalls()  # last: it denies calls the steps above make
        os.close(report_w)
        os.close(alive_r)
    except BaseException as exc:  # whatever it is: report it, never run the code
        message = str(exc) if isinstance(exc, SetupError) else f"{type(exc).__name__}: {exc}"
        os.write(report_w, f"fail {message}\n".encode())
        os._exit(SETUP_FAILED)


def _fail_now(message):
    os.write(1, f"sandbox setup failed: {message}\n".encode())
    os._exit(SETUP_FAILED)


def _outlive_no_parent(init, caller):
    """Return once init has exited; if `caller` (the pid the call is for) dies first (an
    envpool worker killed), kill init, which takes the namespace with it, and exit: nothing of
    the call outlives its caller. Watched through pidfds (Linux 5.3); without them, or without a
    caller, only init is waited for. The caller's pid comes from run.py, not getppid(): the
    parent may be PID 1 by right (a container's entrypoint) or by a death before this started.
    No PR_SET_PDEATHSIG: it fires when the parent *thread* ends, and trio spawns from a thread."""
    if caller is None:
        return
    try:
        watched = [os.pidfd_open(init), os.pidfd_open(caller)]
    except ProcessLookupError:  # the caller is gone already
        watched = []
    except (AttributeError, OSError):
        return
    while watched:
        try:
            ready, _, _ = select.select(watched, [], [])
        except InterruptedError:
            continue
        if watched[0] in ready:
            return
        break
    os.kill(init, _signal.SIGKILL)
    os._exit(1)


def _supervise(init, report_r, caller):
    """Wait for init, then end the way the worker ended (or report a failed setup)."""
    _outlive_no_parent(init, caller)
    while True:
        try:
            _, status = os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    chunks = []
    while chunk := os.read(report_r, 4096):
        chunks.append(chunk)
    lines = b"".join(chunks).decode("utf-8", "replace").splitlines()
    for line in lines:
        if line.startswith("fail "):
            _fail_now(line[5:])
    worker_status = next((int(line[7:]) for line in lines if line.startswith("status ")), status)
    sys.stdout.flush()
    if os.WIFSIGNALED(worker_status):
        sig = os.WTERMSIG(worker_status)
        if sig != _signal.SIGKILL:  # SIGKILL has no handler to reset (signal() raises EINVAL)
            _signal.signal(sig, _signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump this process's core
        os.kill(os.getpid(), sig)  # e.g. SIGXCPU: pytool reports "CPU limit" from the signal
        os._exit(128 + sig)
    code = os.WEXITSTATUS(worker_status) if os.WIFEXITED(worker_status) else 1
    os._exit(1 if code == SETUP_FAILED else code)


def _init(worker, report_w):
    """PID 1: reap everything until the worker ends, pass its status on, exit (killing the rest)."""
    try:
        while True:
            try:
                pid, status = os.wait()
            except InterruptedError:
                continue
            if pid == worker:
                os.write(report_w, f"status {status}\n".encode())
                break
    finally:
        os._exit(0)


def _new_root(workdir, work_bytes, uid, gid):
    """Build the worker's view of the filesystem on a tmpfs over `workdir`, then pivot into it."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount leaks out, nor in
    root = workdir  # any directory will do as the mount point; this one is ours and empty
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    binds = list(_SYSTEM_DIRS) + [p for p in sys.path if p and os.path.isdir(p)]
    made: set[str] = set()
    for source in binds:
        source = os.path.abspath(source)
        if source in made or any(source.startswith(m + "/") for m in made):
            continue  # already visible through an earlier bind
        target = root + source
        if os.path.islink(source):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
            _mount(source, target, None, _MS_BIND | _MS_REC)
        made.add(source)
    os.makedirs(root + "/dev")
    for name in _DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{root}/dev/{name}", "w").close()
            _mount("/dev/" + name, f"{root}/dev/{name}", None, _MS_BIND)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    os.makedirs(root + workdir)
    os.makedirs(root + "/proc")
    _read_only(root, [root] + [root + m for m in made if not os.path.islink(m)])
    options = f"mode=0700,size={work_bytes},nr_inodes=4096,uid={uid},gid={gid}"
    _mount("tmpfs", root + workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    try:  # a fresh /proc shows only this PID namespace; some containers forbid it: then none
        _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except SetupError:
        pass
    os.chdir(root)
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown architecture {os.uname().machine}")
    # pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves no
    # path to the host's files (the trick runc and bubblewrap use).
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "umount the old root")
    os.chdir("/")
    os.chdir(workdir)


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def _read_only(root, mounts):
    """Make the whole tree under `root` read-only: mount_setattr (recursive), else one by one."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    done = _libc.syscall(
        _SYS_MOUNT_SETATTR, _AT_FDCWD, root.encode(), _AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    if done == 0:
        return
    for mount in mounts:  # older kernels: a remount must keep the flags it may not clear
        st = os.statvfs(mount).f_flag
        keep = [(os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC)]
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for bit, ms in keep:
            flags |= ms if st & bit else 0
        _mount(None, mount, None, flags)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]


def _drop_privileges(mechanism, uid, gid):
    """No capability now or after any exec, and (as root) the nobody user."""
    for cap in range(64):  # empty the bounding set: no exec can grant a capability again
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == -1:
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability this kernel knows
                break
            _check(-1, f"prctl(CAPBSET_DROP, {cap})")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # absent before Linux 4.3
    if mechanism == "namespaces":
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability set
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset(none)")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # Changing uid made the process non-dumpable, which gives its /proc/self to root: give it
    # back (no core dumps: RLIMIT_CORE is 0; nobody outside this PID namespace can see it).
    _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in data) or 0 in os.getresuid():
        raise SetupError("dropping privileges: capabilities or uid 0 remain")

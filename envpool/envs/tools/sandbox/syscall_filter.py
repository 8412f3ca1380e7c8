"""A seccomp filter for the jailed worker: the kernel interfaces its code has no use for, denied.

Imported by jail.py (stdlib and ctypes only, like it) and installed last, after the worker has
dropped every privilege and set no_new_privs (which is what lets an unprivileged process
install a filter at all). Once installed it cannot be removed, and every process the code
forks or execs inherits it.

Why a filter on top of the namespaces: they hide the host, but the kernel interfaces reachable
from inside stay open. As nobody with no capabilities the code could still create a user
namespace (`unshare(CLONE_NEWUSER)`), be root inside it, and from there make mount and network
namespaces and mount filesystems: each of those is kernel code that sees attacker-chosen input,
the usual first step of a container escape. The filter answers EPERM for:

- namespaces and mounts: `unshare`, `setns`, `clone` with any CLONE_NEW* flag, `mount`,
  `umount2`, `pivot_root`, `chroot` and the new mount API (`fsopen` ... `mount_setattr`);
- other processes' memory and the debugger: `ptrace`, `process_vm_readv/writev`, `kcmp`,
  `pidfd_getfd`, `process_madvise`;
- kernel facilities with a long record of bugs reachable by users: `bpf`, `perf_event_open`,
  `userfaultfd`, `io_uring_*`, `keyctl`/`add_key`/`request_key`, `fanotify_init`,
  `open_by_handle_at`/`name_to_handle_at`;
- sockets of a family other than AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK (EAFNOSUPPORT):
  the first socket of a family loads its kernel module (TIPC, RDS, vsock: known exploits);
- what needs privileges it no longer has anyway (modules, kexec, reboot, swap, quotas, acct,
  syslog, I/O ports, vhangup): denied here too, so a kernel bug in a capability check is not
  enough.

`clone3` answers ENOSYS instead: its flags sit in a struct a seccomp filter cannot read, and
glibc (2.34+) falls back to `clone`, whose flags it can. That is what Docker's and systemd's
filters do. Threads, fork, subprocess and multiprocessing keep working.

A call made through another architecture's entry (the i386 `int 0x80` on x86_64, 32-bit ARM
on arm64) kills the process: the numbers below would mean other calls there. On x86_64 the
x32 entry (numbers with bit 30 set) answers EPERM for the same reason.

Only architectures whose numbers are written here get a filter (x86_64, aarch64, riscv64);
`install` says why not otherwise, and the sandbox's preflight line reports it.
"""

import ctypes
import os

__all__ = ["ARCHES", "DENIED", "SOCKET_FAMILIES", "install", "program"]

_PR_GET_SECCOMP, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 21, 22, 2
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_X32_BIT = 0x40000000
# unshare/clone flags that make a namespace (CLONE_NEWTIME, 0x80, is clone3/unshare only:
# for clone that bit is part of the exit signal).
_CLONE_NEW_ANY = 0x02000000 | 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# Linux's own numbering: arch/x86/entry/syscalls/syscall_64.tbl, and include/uapi/asm-generic/
# unistd.h for arm64 and riscv64 (which share it).
_GENERIC = {
    "ptrace": 117, "syslog": 116, "acct": 89, "mount": 40, "umount2": 39, "swapon": 224,
    "swapoff": 225, "reboot": 142, "pivot_root": 41, "chroot": 51, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "quotactl": 60, "lookup_dcookie": 18,
    "kexec_load": 104, "kexec_file_load": 294, "add_key": 217, "request_key": 218,
    "keyctl": 219, "unshare": 97, "setns": 268, "perf_event_open": 241,
    "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "bpf": 280,
    "userfaultfd": 282, "open_by_handle_at": 265, "name_to_handle_at": 264,
    "fanotify_init": 262, "vhangup": 58, "clone": 220, "socket": 198, "socketpair": 199,
}  # fmt: skip
_X86_64 = {
    "ptrace": 101, "syslog": 103, "acct": 163, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "pivot_root": 155, "chroot": 161, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
    "kexec_load": 246, "kexec_file_load": 320, "add_key": 248, "request_key": 249,
    "keyctl": 250, "unshare": 272, "setns": 308, "perf_event_open": 298,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "bpf": 321,
    "userfaultfd": 323, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "fanotify_init": 300, "vhangup": 153, "clone": 56, "socket": 41, "socketpair": 53,
    "iopl": 172, "ioperm": 173, "uselib": 134, "_sysctl": 156, "modify_ldt": 154,
}  # fmt: skip
# Numbered alike on every architecture since Linux 5.1.
_UNIFIED = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "clone3": 435, "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442,
    "quotactl_fd": 443,
}  # fmt: skip
# machine -> (AUDIT_ARCH_* value, syscall numbers)
ARCHES = {
    "x86_64": (0xC000003E, {**_X86_64, **_UNIFIED}),
    "aarch64": (0xC00000B7, {**_GENERIC, **_UNIFIED}),
    "riscv64": (0xC00000F3, {**_GENERIC, **_UNIFIED}),
}
_CHECKED = ("clone", "clone3", "socket", "socketpair")  # decided by their arguments, or ENOSYS
#: The calls denied outright (EPERM); clone is denied only with a namespace flag, socket and
#: socketpair for a family outside SOCKET_FAMILIES, clone3 answers ENOSYS.
DENIED = tuple(sorted((set(_X86_64) | set(_GENERIC) | set(_UNIFIED)) - set(_CHECKED)))
#: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: other families (DCCP is a protocol of AF_INET, but
#: TIPC, RDS, vsock, ...) load kernel modules on first use, a known source of exploits.
SOCKET_FAMILIES = (1, 2, 10, 16)


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8)]
    _fields_ += [("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


# One step: (its label, code, where to jump if true, where if false, k); None jumps to the next.
_Step = tuple[str | None, int, str | None, str | None, int]


def _program(arch: int, numbers: dict[str, int]) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions, jumps resolved from labels."""
    deny = sorted({n for name, n in numbers.items() if name not in _CHECKED})
    steps: list[_Step] = [
        (None, _LD_W_ABS, None, None, 4),  # seccomp_data.arch
        (None, _JEQ_K, None, "kill", arch),
        (None, _LD_W_ABS, None, None, 0),  # seccomp_data.nr
    ]
    if arch == ARCHES["x86_64"][0]:
        steps.append((None, _JGE_K, "eperm", None, _X32_BIT))
    steps += [(None, _JEQ_K, "eperm", None, n) for n in deny]
    steps += [
        (None, _JEQ_K, "enosys", None, numbers["clone3"]),
        (None, _JEQ_K, "clone", None, numbers["clone"]),
        (None, _JEQ_K, "socket", None, numbers["socket"]),
        (None, _JEQ_K, "socket", None, numbers["socketpair"]),
        (None, _RET_K, None, None, _RET_ALLOW),
        # args[0] is at offset 16; its low half (little-endian) holds the flags or the family.
        ("clone", _LD_W_ABS, None, None, 16),
        (None, _JSET_K, "eperm", None, _CLONE_NEW_ANY),
        (None, _RET_K, None, None, _RET_ALLOW),
        ("socket", _LD_W_ABS, None, None, 16),
        *[(None, _JEQ_K, "allow", None, family) for family in SOCKET_FAMILIES],
        (None, _RET_K, None, None, _RET_ERRNO | _EAFNOSUPPORT),
        ("allow", _RET_K, None, None, _RET_ALLOW),
        ("eperm", _RET_K, None, None, _RET_ERRNO | _EPERM),
        ("enosys", _RET_K, None, None, _RET_ERRNO | _ENOSYS),
        ("kill", _RET_K, None, None, _RET_KILL_PROCESS),
    ]
    at = {label: i for i, (label, *_) in enumerate(steps) if label is not None}

    def offset(target: str | None, i: int) -> int:
        jump = 0 if target is None else at[target] - i - 1
        if not 0 <= jump <= 255:  # a jump is one byte: a longer one would wrap, silently
            raise ValueError(f"the filter's jump to {target!r} is {jump} instructions long")
        return jump

    return [(code, offset(jt, i), offset(jf, i), k) for i, (_, code, jt, jf, k) in enumerate(steps)]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for `machine` (a key of ARCHES) as (code, jt, jf, k) instructions."""
    arch, numbers = ARCHES[machine]
    return _program(arch, numbers)


def install() -> str | None:
    """Install the filter on this process (and all it will start); None, or why not (one line).

    Needs no_new_privs or CAP_SYS_ADMIN. An error other than "this kernel or architecture has
    no seccomp" raises OSError: a filter that should go on and did not is a failed setup."""
    machine = os.uname().machine
    if machine not in ARCHES:
        return f"no syscall numbers for {machine}"
    steps = program(machine)
    instructions = (_Instruction * len(steps))(*[_Instruction(*s) for s in steps])
    fprog = _Program(len(steps), instructions)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0:
        return None
    errno = ctypes.get_errno()
    # EINVAL is both "no seccomp in this kernel" and "a program it refuses": ask which.
    if errno == 22 and libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) == -1 and ctypes.get_errno() == 22:
        return "this kernel has no seccomp"
    raise OSError(errno, f"prctl(SECCOMP_MODE_FILTER): {os.strerror(errno)}")

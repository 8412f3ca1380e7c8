"""Start-up and exit chores every role process shares: arguments, config, logging, model path,
fd limit, and how it ends (`run_role`).

Each role's entry point (`python -m millstream.actor`, `... learner`, `... envpool`, or
`millstream actor|learner|envpool`) takes the same arguments:

    --config FILE      TOML config (default: the embedded one)
    --ready-file FILE  written (JSON) once the role serves, for launchers and tests
    key.sub=value ...  dotted overrides, applied after the file

`run_role` wraps a role's body: it stops the role when its launcher dies, turns a stop by signal
into exit status 130, writes the cause of a fatal error to `<run.dir>/logs/<name>.exit.json`
(the launcher reports it, instead of a traceback's last line), exits 78 for a failure a restart
would repeat (`fails_again`: the launcher then stops instead of retrying), and stops any child
process the role leaves behind (`shared/process/lifecycle.py`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import random
import resource
import socket
import sys
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import orjson

from millstream.shared.config import Config, ConfigError, load_config
from millstream.shared.process.allocator import allocator_environment
from millstream.shared.process.cpus import apply_share, role_share
from millstream.shared.process.lifecycle import reap_children, start_again_with, stop_on_signals, watch_parent
from millstream.shared.process.openmp import openmp_environment

__all__ = [
    "engine_environment",
    "role_args",
    "run_role",
    "setup_logging",
    "resolve_model_dir",
    "check_model_dir",
    "check_tensor_parallel",
    "raise_fd_limit",
    "write_ready",
    "free_port",
    "bind_problem",
    "ENV_NAME",
    "STOPPED",
    "ACCOUNTING_FAILED",
    "SETUP_FAILED",
    "exit_file",
    "ready_file",
]

#: The name the launcher gave this process ("actor", "learner", "envpool-0", ...).
ENV_NAME = "MILLSTREAM_NAME"

#: Exit status of a role stopped by SIGTERM or SIGINT (as a shell reports Ctrl-C).
STOPPED = 130

#: Exit status of a learner that finished but whose episode accounting does not add up.
ACCOUNTING_FAILED = 3

#: Exit status of a role that failed in a way a restart would repeat exactly: its config, an
#: import, an address it cannot bind (sysexits' EX_CONFIG). The launcher does not restart it.
SETUP_FAILED = 78


def role_args(
    role: str,
    argv: list[str] | None = None,
    *,
    check: str = "",
    options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[Config, argparse.Namespace]:
    """Parse a role's arguments and load its config; `check` documents the role's `--check`,
    `options` adds the role's own flags."""
    parser = argparse.ArgumentParser(prog=f"millstream {role}", description=f"run the {role} role")
    if check:
        parser.add_argument("--check", action="store_true", help=check)
    if options is not None:
        options(parser)
    parser.add_argument("--config", default=None, help="TOML config file (default: embedded)")
    parser.add_argument("--ready-file", default=None, help="write JSON here once serving")
    parser.add_argument("--worker-index", type=int, default=0, help="index among same-role workers")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    ns = parser.parse_args(argv)
    cfg = load_config(ns.config, ns.overrides)
    setup_logging(cfg.run.log_level, role)
    return cfg, ns


def run_role(
    role: str,
    body: Callable[[Config, argparse.Namespace], int | None],
    argv: list[str] | None = None,
    *,
    check: str = "",
    options: Callable[[argparse.ArgumentParser], None] | None = None,
    reap_grace_s: float = 5.0,
    preload: bool = False,
) -> NoReturn:
    """Parse the role's arguments, run `body(cfg, ns)`, and exit with its status (see above);
    `preload`: under the configured memory allocator and OpenMP wait policy (the actor:
    shared/process/allocator.py, shared/process/openmp.py)."""
    try:
        cfg, ns = role_args(role, argv, check=check, options=options)
    except ConfigError as exc:
        print(f"millstream {role}: {exc}", file=sys.stderr)
        sys.exit(2)
    if preload:
        try:
            # May start this process again: before anything that must last.
            start_again_with(engine_environment(cfg))
        except (ConfigError, OSError) as exc:  # a path that is not there; an exec that failed
            print(f"millstream {role}: {exc}", file=sys.stderr)
            sys.exit(SETUP_FAILED)
    stop_on_signals()
    watch_parent()
    _take_cores(role, cfg, ns)
    log = logging.getLogger(role)
    code: int = 1
    try:
        code = body(cfg, ns) or 0
    except BaseException as exc:  # the cause may come wrapped in task groups' ExceptionGroups
        first = _root_cause(exc)
        if isinstance(first, KeyboardInterrupt):  # SIGINT, or SIGTERM (stop_on_signals)
            log.info("%s stopped", role)
            code = STOPPED
        elif isinstance(first, SystemExit) and isinstance(first.code, int | None):
            code = first.code or 0
        else:
            log.exception("%s failed", role)
            _write_exit_cause(cfg, exc)
            code = SETUP_FAILED if fails_again(first) else 1
    finally:
        reap_children(reap_grace_s)
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, once the role's own work is closed.

    A learner spent 1.75 s after its last log line freeing torch, DeepSpeed and transformers
    module by module (strace: no system call in between), and the launcher waits for that
    before it stops the other roles: every run ended two seconds late. The exit handlers still
    run (logging flushes its files), then the process ends. What a role writes it must close
    itself, on every path out (the learner's loop closes its records and metrics on a stop or a
    failure too; the actor shuts its engine down in a `finally`); the roles' own threads are
    daemons, and a thread some library leaves running is not waited for.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing left to say there
            pass
    os._exit(code)


def engine_environment(cfg: Config) -> dict[str, str]:
    """What the actor's engine needs in its environment from its start, and this process lacks:
    the allocator's `LD_PRELOAD` and OpenMP's wait policy (both read once, when loaded). The
    actor starts itself again with it; a benchmark gives it to the engines it starts."""
    return {**allocator_environment(cfg), **openmp_environment(cfg)}


def _take_cores(role: str, cfg: Config, ns: argparse.Namespace) -> None:
    """This process's cores and thread counts (shared/process/cpus.py), before the role's work
    starts a thread pool; a `--check` run computes nothing."""
    if getattr(ns, "check", False):
        return
    index = int(os.environ.get("RANK", "0")) if role == "learner" else getattr(ns, "worker_index", 0)
    share = role_share(cfg, role, index, judge=getattr(ns, "judge", False))
    apply_share(share)
    if share.cores is not None:
        logging.getLogger(role).info("on cores %s with %s threads", list(share.cores), share.threads)


def ready_file(run_dir: str | Path, name: str) -> Path:
    """Where the process called `name` says it serves (`--ready-file`, as the launcher passes it)."""
    return Path(run_dir) / "logs" / f"{name}.ready"


def exit_file(run_dir: str | Path, name: str) -> Path:
    """Where the process called `name` writes why it failed."""
    return Path(run_dir) / "logs" / f"{name}.exit.json"


def _leaves(exc: BaseException) -> list[BaseException]:
    """The errors inside task-group wrappers (ExceptionGroups, as anyio raises them)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def fails_again(exc: BaseException) -> bool:
    """Would a restart fail the same way? A bad config or model directory (ConfigError), a
    missing module, an address in use or not on this host: nothing changes between restarts."""
    if isinstance(exc, ConfigError | ImportError):
        return True
    # zmq.ZMQError and OSError both carry the errno; zmq is not imported for the check.
    return getattr(exc, "errno", None) in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def _root_cause(exc: BaseException) -> BaseException:
    return _leaves(exc)[0]


def _write_exit_cause(cfg: Config, exc: BaseException) -> None:
    name = os.environ.get(ENV_NAME)
    if not (cfg.run.dir and name):
        return
    leaves = _leaves(exc)
    exc = leaves[0]
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    record: dict[str, Any] = {
        "name": name,
        "error": type(exc).__name__,
        "message": str(exc)[:2000]
        + (f" (and {len(leaves) - 1} more errors: see the log)" if len(leaves) > 1 else ""),
        "at": f"{where[0].filename}:{where[0].lineno}" if where else "",
    }
    try:
        exit_file(cfg.run.dir, name).write_bytes(orjson.dumps(record))
    except OSError:
        pass  # the run directory is gone; the log still has the traceback


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def check_model_dir(path: str | Path, key: str = "model.path") -> Path:
    """A Hugging Face model directory (config.json, tokenizer.json, tokenizer_config.json), or a
    ConfigError naming the key and what is missing."""
    where = Path(path).expanduser()
    if not where.is_dir():
        from millstream.shared.models.smollm2 import default_dir

        fetch = " (`make real-model` puts the model there)" if where == default_dir() else ""
        raise ConfigError(f"{key} = {str(path)!r}: not a directory{fetch}")
    missing = [
        f for f in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (where / f).is_file()
    ]
    if missing:
        # tokenizer.json too: the envpool tokenizes with the `tokenizers` library (no torch).
        raise ConfigError(
            f"{key} = {str(path)!r}: not a model directory millstream can use (no {', '.join(missing)})"
        )
    return where


def check_tensor_parallel(model_dir: str | Path, size: int, key: str = "actor.tensor_parallel_size") -> None:
    """Can vLLM split this model across `size` workers? A ConfigError naming the key if not.

    vLLM gives each tensor-parallel worker an equal share of the attention heads, so `size` must
    divide them; key/value heads are split the same way when there are at least `size` of them
    and copied to several workers when there are fewer (then `size` must be a multiple of them).
    vLLM checks this only after its worker processes started (a minute on CPU) and words it
    without our key; read from the model's config.json, it costs nothing before any role starts.
    A config.json without the usual head counts is left for vLLM to judge.
    """
    if size == 1:
        return
    config_path = Path(model_dir).expanduser() / "config.json"
    try:
        config = orjson.loads(config_path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ConfigError(f"{key} = {size}: cannot read {config_path} ({exc})") from None
    config = config.get("text_config", config)  # multimodal models nest the language model's
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return
    kv_heads = config.get("num_key_value_heads", heads)
    where = f"(from {config_path})"
    if heads % size:
        raise ConfigError(
            f"{key} = {size}: must divide the model's {heads} attention heads {where}; "
            f"choose one of {_divisors(heads)}"
        )
    if isinstance(kv_heads, int) and (kv_heads % size if kv_heads >= size else size % kv_heads):
        raise ConfigError(
            f"{key} = {size}: the model's {kv_heads} key/value heads must be split evenly "
            f"(a size dividing them) or copied evenly (a multiple of them) {where}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_model_dir(cfg: Config) -> str:
    """The model directory to load: `model.path`, or the tiny model (built on first use)."""
    if cfg.model.path:
        return str(check_model_dir(cfg.model.path))
    from millstream.shared.models.tiny import build_tiny_model

    return str(build_tiny_model(Path(cfg.model.tiny_dir).expanduser(), seed=cfg.model.tiny_seed))


def raise_fd_limit(want: int = 65536) -> int:
    """Raise the soft open-file limit toward `want` (many sockets, many episodes); return it.

    Peers silently scored episodes 0 when they hit EMFILE at ~1,024 rollouts. We raise the limit
    at start and say so when the hard limit is lower than asked.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < want:
        logging.getLogger(__name__).warning(
            "open-file limit is %d (hard limit %s), below the %d asked for", soft, hard, want
        )
    return soft


def write_ready(path: str | None, **info) -> None:
    """Atomically write the ready file (launchers poll for it)."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(orjson.dumps({"pid": os.getpid(), **info}))
    tmp.replace(path)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host`, below the kernel's ephemeral range.

    The launcher picks a role's port here and the role binds it seconds later. A port the OS
    hands out for port 0 lies in the ephemeral range, which every outgoing connection draws its
    local port from, so a busy process (Ray's raylets and workers open hundreds) can take it in
    between: the role then fails with "Address already in use". Ports between 20000 and the start
    of that range are never handed out implicitly (and stay above Ray's worker ports, 10002 to
    19999 by default), so only an explicit bind can take them; that is left to chance. Falls
    back to the OS's pick where the range is unknown or too small.

    Never a port it handed out lately (`_HANDED_OUT`): the launcher picks all of a run's ports
    before any role binds one, so each is still free when the next is picked, and two random
    picks coincided (a run's experience and version addresses on one port: its learner failed
    at its bind; about one run in a thousand).
    """
    low = _ephemeral_start()
    if low > _FIRST_QUIET_PORT + 64:
        for _ in range(64):
            port = random.randrange(_FIRST_QUIET_PORT, low)
            if port not in _HANDED_OUT and _bindable(host, port):
                _HANDED_OUT.append(port)
                return port
    for _ in range(64):
        with socket.socket(_family(host)) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT.append(port)
    return port


_FIRST_QUIET_PORT = 20000
#: The ports `free_port` handed out last, which it does not hand out again.
_HANDED_OUT: deque[int] = deque(maxlen=1024)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: let the OS pick


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_problem(host: str, port: int) -> str | None:
    """Why a listener could not bind host:port now, or None. SO_REUSEADDR as libzmq sets it, so a
    port left in TIME_WAIT by an earlier run (which ZeroMQ can bind) is not reported."""
    with socket.socket(_family(host)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "another process already listens there"
            return f"cannot bind it here ({exc.strerror})"
    return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host)) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True

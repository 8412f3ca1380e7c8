"""Start-up chores every role process shares: arguments, config, logging, model path, fd limit.

Each role's entry point (`python -m millstream.actor`, `... learner`, `... envpool`, or
`millstream actor|learner|envpool`) takes the same arguments:

    --config FILE      TOML config (default: the embedded one)
    --ready-file FILE  written (JSON) once the role serves, for launchers and tests
    key.sub=value ...  dotted overrides, applied after the file
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import sys
from pathlib import Path

import orjson

from .config import Config, load_config

__all__ = ["role_args", "setup_logging", "resolve_model_dir", "raise_fd_limit", "write_ready",
           "free_port"]


def role_args(role: str, argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog=f"millstream {role}", description=f"run the {role} role")
    parser.add_argument("--config", default=None, help="TOML config file (default: embedded)")
    parser.add_argument("--ready-file", default=None, help="write JSON here once serving")
    parser.add_argument("--worker-index", type=int, default=0, help="index among same-role workers")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    ns = parser.parse_args(argv)
    cfg = load_config(ns.config, ns.overrides)
    setup_logging(cfg.run.log_level, role)
    return cfg, ns


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def resolve_model_dir(cfg: Config) -> str:
    """The model directory to load: `model.path`, or the tiny model (built on first use)."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path={cfg.model.path!r} has no config.json")
        return str(path)
    from .tinymodel import build_tiny_model

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
            "open-file limit is %d (hard limit %s), below the %d asked for", soft, hard, want)
    return soft


def write_ready(path: str | None, **info) -> None:
    """Atomically write the ready file (launchers poll for it)."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(orjson.dumps({"pid": os.getpid(), **info}))
    tmp.replace(path)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the OS picks; another process could take it later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

"""The `millstream` command: one entry point per role, the launcher, and small tools.

    millstream run [config.toml] [key=value ...]   start and supervise a whole run
    millstream actor|learner|envpool [args ...]    run one role (see `--help` of each)
    millstream stress --env NAME --episodes N ...  how many concurrent episodes hold (bench/stress.py)
    millstream tiny-model DIR [--seed N ...]       build the tiny random Qwen2 model
    millstream config                              every config key, default and meaning

Role commands replace this process with `python -m millstream.<role>`: `shared` imports no role package,
and a role started by hand is the very same process the launcher starts.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]

ROLES = ("actor", "learner", "envpool")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command in ROLES:
        os.execv(sys.executable, [sys.executable, "-m", f"millstream.{command}", *rest])
    if command == "stress":
        os.execv(sys.executable, [sys.executable, "-m", "millstream.bench.stress", *rest])
    if command == "run":
        from .config import ConfigError
        from .launcher import launch

        path = rest[0] if rest and "=" not in rest[0] else None
        overrides = rest[1:] if path else rest
        try:
            sys.exit(launch(path, overrides))
        except ConfigError as exc:
            print(f"millstream run: {exc}", file=sys.stderr)
            sys.exit(2)
    if command == "tiny-model":
        from .tinymodel import main as tiny_main

        tiny_main(rest)
        return
    if command == "config":
        from .config import describe_config

        print(describe_config())
        return
    print(f"millstream: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()

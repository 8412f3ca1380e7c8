"""The `millstream` command: one entry point per role, the launcher, and small tools.

    millstream run [config.toml] [key=value ...]   start and supervise a whole run
    millstream actor|learner|envpool [args ...]    run one role (see `--help` of each)
    millstream stress --env NAME --episodes N ...  how many concurrent episodes hold (bench/stress.py)
    millstream plot RUN_DIR [--out DIR]            PNGs of the run's curves (shared/inspect/plot.py)
    millstream inspect RUN_DIR [filters] [--serve] the run's episodes, one turn by turn (--help)
    millstream debug [RUN_DIR] [--episode ROW ...] one episode under a GDB-like prompt (--help)
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
        sys.exit(run(rest))
    if command == "plot":
        from millstream.shared.inspect.plot import main as plot_main

        sys.exit(plot_main(rest))
    if command == "inspect":
        from millstream.shared.inspect.cli import main as inspect_main

        sys.exit(inspect_main(rest))
    if command == "debug":
        os.execv(sys.executable, [sys.executable, "-m", "millstream.envpool.debug.repl", *rest])
    if command == "tiny-model":
        from millstream.shared.models.tiny import main as tiny_main

        tiny_main(rest)
        return
    if command == "config":
        from millstream.shared.config import describe_config

        print(describe_config())
        return
    print(f"millstream: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    sys.exit(2)


RUN_USAGE = """usage: millstream run [CONFIG.toml] [section.key=value ...]

Starts and supervises a whole run (actor, learner, envpool workers) from one config: the
embedded defaults, then CONFIG.toml if given, then the overrides. Everything is checked before
any role starts. `run.resume=RUN_DIR` continues a run from its latest checkpoint.

Examples:
  millstream run                                    the tiny model learns `evenchars`
  millstream run my.toml train.steps=100 envpool.env=bandit
  millstream run run.resume=runs/run-20261123-101500

The config keys, with their defaults:
"""


def run(args: list[str]) -> int:
    """`millstream run`: usage on --help; a ConfigError is one line and exit status 2."""
    from millstream.shared.config import ConfigError, describe_config, parse_overrides
    from millstream.shared.launch.launcher import launch

    if any(a in ("-h", "--help") for a in args):
        print(RUN_USAGE + describe_config())
        return 0
    try:
        path = None
        if args and "=" not in args[0]:
            first = args[0]
            if not (first.endswith(".toml") or "/" in first or os.path.exists(first)):
                parse_overrides([first])  # not a file: an override without '=', say so
            path, args = first, args[1:]
        return launch(path, args)
    except ConfigError as exc:
        print(f"millstream run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    main()

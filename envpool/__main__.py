"""`python -m millstream.envpool` (`millstream envpool`): one envpool worker process.

`--check` runs the envpool's preflight (envpool/preflight.py) and exits; otherwise the worker runs
on trio until the learner is final or a signal stops it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from millstream.envpool.worker import run_worker
from millstream.shared.config import Config

log = logging.getLogger("envpool")


def main(argv: list[str] | None = None) -> None:
    from millstream.shared.process.lifecycle import run_until_signal
    from millstream.shared.process.runtime import STOPPED, raise_fd_limit, run_role

    def body(cfg: Config, ns: Any) -> int:
        if ns.check:
            from millstream.envpool.preflight import preflight

            return preflight(cfg)
        raise_fd_limit()
        started = time.monotonic()
        stats, stopped = anyio.run(
            run_until_signal, run_worker, cfg, ns.worker_index, ns.ready_file, backend="trio"
        )
        log.info("envpool exited after %.1fs: %s", time.monotonic() - started, stats)
        return STOPPED if stopped else 0

    run_role(
        "envpool",
        body,
        argv,
        check="check the envpool's settings (environment, its "
        "arguments, tokenizer, a first prompt against the context) and exit",
    )


if __name__ == "__main__":
    main()

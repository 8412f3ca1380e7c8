"""An actor for the debugger on a checkpoint's weights: started for a session, stopped with it.

`millstream debug --checkpoint PATH` and `--replay ... --against A B` need an engine serving a
given checkpoint. It is the real actor role (`python -m millstream.actor`), started by the run's
`Supervisor` (shared/process/supervisor.py: its own process group, as the launcher starts roles) with the
session's config and `model.path` set to the checkpoint's HF export (`checkpoints/step_N/hf`, or
any model directory), on a free loopback port. The envpool package imports no engine: the
engine lives in that child process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from millstream.shared.config import Config, ConfigError, dump_config
from millstream.shared.process.runtime import free_port
from millstream.shared.process.supervisor import Supervisor

__all__ = ["actor_for_checkpoint", "checkpoint_model_dir"]

_PREFIX = "millstream-debug-actor-"


def checkpoint_model_dir(path: Path) -> Path:
    """`path/hf` for a learner checkpoint, `path` for a model directory; else a ConfigError."""
    for candidate in (path / "hf", path):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"{path} is neither a checkpoint (with hf/) nor a model directory (with config.json)")


@contextlib.contextmanager
def actor_for_checkpoint(path: Path, cfg: Config, timeout_s: float = 600.0) -> Iterator[str]:
    """Start an actor on `path`'s weights; yields its address; stops it on exit."""
    model_dir = checkpoint_model_dir(path)
    _remove_abandoned_folders()
    with tempfile.TemporaryDirectory(prefix=_PREFIX) as tmp:
        folder = Path(tmp)
        (folder / "owner.pid").write_text(str(os.getpid()))
        (folder / "logs").mkdir()
        (folder / "config.toml").write_text(dump_config(cfg))
        address = f"tcp://127.0.0.1:{free_port()}"
        ready = folder / "ready.json"
        # The run's supervisor: its own process group, stopped with the debugger (and by itself
        # if the debugger dies: it watches its parent), its log in logs/actor.log.
        sup = Supervisor(folder)
        sup.start(
            "actor",
            "millstream.actor",
            [
                *("--config", str(folder / "config.toml"), "--ready-file", str(ready)),
                *(f"model.path={model_dir}", f"actor.address={address}", "actor.replicas=1"),
                # A run's config pins its replicas' addresses, and a replica binds its entry
                # there, not actor.address: pin this one's to the address the debugger talks to.
                f'actor.replica_addresses=["{address}"]',
            ],
        )
        try:
            print(f"starting an actor on {model_dir} ...", flush=True)
            deadline = time.monotonic() + timeout_s
            while not ready.exists():
                if "actor" in sup.exited():
                    why = sup.describe_exit("actor", sup.exited()["actor"])
                    raise RuntimeError(f"the actor on {model_dir} ended before it was ready: {why}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the actor on {model_dir} was not ready within {timeout_s}s")
                time.sleep(0.2)
            yield address
        finally:
            sup.stop(grace_s=20)


def _remove_abandoned_folders() -> None:
    """The folders of debug sessions that were killed (SIGKILL leaves no time to clean up): their
    owner is gone, and so is their actor (it stops when its parent dies)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        try:
            os.kill(int((folder / "owner.pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):
            continue  # not ours to judge (no owner file yet, another user's)

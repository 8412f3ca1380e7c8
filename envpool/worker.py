"""An envpool worker: admits groups of episodes and runs them all as tasks on one event loop.

    millstream envpool [--config run.toml] [--worker-index I]

Sockets: one DEALER to the actor (every episode's requests, multiplexed), one SUB for the
learner's `PolicyVersion`s (they drive the admission gate), one PUSH of `Trajectory` /
`EpisodeFailed` to the learner.

Life of a worker: wait for the learner's first version; make sure the actor answers (`Hello`,
bounded retries); then, as long as the gate allows and
capacity (`envpool.max_concurrent_episodes`) remains, start the next group: `group_size` episodes
with the same environment seed. When the learner announces `final`, stop admitting, cancel the
episodes still running (each is reported as failed with cause `run_ended`, so nothing is lost),
send `PoolDone` with this worker's totals, and exit.

Accounting is exact by construction: every started episode sends exactly one message to the
learner, a trajectory or a failure.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import anyio

from millstream.shared.config import Config
from millstream.shared.metrics import MetricsWriter, NullMetrics
from millstream.shared.protocol import EpisodeFailed, PolicyVersion, PoolDone, Trajectory, group_id
from millstream.shared.transport import open_channel

from .chat import ChatFormat
from .client import ActorClient
from .envs import make_env
from .episode import EpisodeSpec, run_episode
from .gate import AdmissionGate

__all__ = ["run_worker", "WorkerStats", "ActorUnavailable", "tokenizer_dir"]

log = logging.getLogger("envpool")


@dataclass
class WorkerStats:
    started: int = 0
    finished: int = 0
    failed: Counter = field(default_factory=Counter)
    live: int = 0
    groups: int = 0
    #: Episodes failed in a row by the actor's fault; reset by any other outcome.
    actor_failure_streak: int = 0


class ActorUnavailable(RuntimeError):
    """Too many episodes in a row failed on the actor's side: stop instead of burning episodes."""


def tokenizer_dir(cfg: Config) -> str:
    """The model directory whose tokenizer and chat template the envpool uses.

    The envpool never builds the tiny model (that needs torch); the launcher or actor does.
    """
    path = Path(cfg.model.path or cfg.model.tiny_dir).expanduser()
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}: set model.path (the launcher does) or build the tiny "
            "model first with `millstream tiny-model DIR`")
    return str(path)


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc), or its peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def group_seed(run_seed: int, group_number: int) -> int:
    return (run_seed * 7_919_981 + group_number * 104_729 + 17) % (2**31 - 1)


async def run_worker(cfg: Config, worker_index: int = 0, ready_file: str | None = None,
                     actor_address: str | None = None,
                     stats_hook: Callable[[WorkerStats], None] | None = None) -> WorkerStats:
    """Run one worker until the learner is final; `stats_hook` receives the live stats object."""
    chat = ChatFormat.from_model_dir(tokenizer_dir(cfg))
    actor_address = actor_address or cfg.actor.connect or cfg.actor.address
    name = f"w{worker_index}"
    pool = cfg.envpool
    make_env(pool.env, pool.env_args)  # fail fast on a bad name or bad arguments
    dealer = open_channel("dealer", actor_address, bind=False, cfg=cfg.transport, recv_queue=4096)
    sub = open_channel("sub", cfg.learner.version_address, bind=False, cfg=cfg.transport)
    push = open_channel("push", cfg.learner.experience_address, bind=False, cfg=cfg.transport)
    client = ActorClient(dealer, name)
    gate = AdmissionGate(worker_index=worker_index, workers=pool.workers)
    stats = WorkerStats()
    if stats_hook is not None:
        stats_hook(stats)
    slots = anyio.Semaphore(pool.max_concurrent_episodes)
    starting = anyio.CapacityLimiter(pool.max_starting_envs)
    max_model_len = cfg.actor.max_model_len
    group_size = cfg.train.group_size
    if group_size > pool.max_concurrent_episodes:
        raise ValueError(f"train.group_size={group_size} exceeds envpool.max_concurrent_episodes="
                         f"{pool.max_concurrent_episodes}: a group could never start")

    async def report(message: Trajectory | EpisodeFailed) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled episode still reports its end
            await push.send(message)

    async def one_episode(spec: EpisodeSpec) -> None:
        result: Trajectory | EpisodeFailed | None = None
        try:
            env = make_env(pool.env, pool.env_args)
            result = await run_episode(spec, env, chat, client, pool, max_model_len, starting)
        except anyio.get_cancelled_exc_class():
            result = EpisodeFailed(spec.episode_id, spec.group_id, spec.group_size, "run_ended",
                                   "the learner finished while this episode ran")
            raise
        except Exception as exc:  # a bug of ours must still not lose the episode
            log.exception("episode %s crashed", spec.episode_id)
            result = EpisodeFailed(spec.episode_id, spec.group_id, spec.group_size,
                                   "envpool_error", f"{type(exc).__name__}: {exc}"[:500])
        finally:
            if isinstance(result, Trajectory):
                stats.finished += 1
            else:
                stats.failed[result.cause] += 1
            actor_fault = not isinstance(result, Trajectory) and result.cause.startswith("actor_")
            stats.actor_failure_streak = stats.actor_failure_streak + 1 if actor_fault else 0
            stats.live -= 1
            slots.release()
            await report(result)
        if stats.actor_failure_streak > pool.max_consecutive_actor_failures:
            raise ActorUnavailable(
                f"{stats.actor_failure_streak} episodes in a row failed on the actor's side, the "
                f"last with {result.cause}: {result.message}")

    async def greet_actor() -> None:
        info = await client.handshake(timeout_s=pool.actor_connect_timeout_s,
                                      retries=pool.actor_retries,
                                      backoff_s=pool.actor_retry_backoff_s)
        log.info("%s: actor at %s serves %s (version %d)", name, actor_address, info.model,
                 info.version)

    async def admit_groups(episodes) -> None:
        greeted = False
        while True:
            number = await gate.admit(pool.version_timeout_s)
            if number is None:
                return
            if not greeted:
                # Only now: the learner announces its first version after the actor took its
                # weights, so an actor still loading (a minute for vLLM) is not taken for gone.
                await greet_actor()
                greeted = True
            for _ in range(group_size):
                try:  # the free-slot case must not wait a scheduler round per slot: at 10,000
                    slots.acquire_nowait()  # episodes that alone made filling the pool take 8 s
                except anyio.WouldBlock:
                    await slots.acquire()
            seed = group_seed(cfg.run.seed, number)
            gid = group_id(number)
            stats.groups += 1
            for member in range(group_size):
                spec = EpisodeSpec(f"{gid}-e{member}", gid, seed, member, group_size, pool.env)
                stats.started += 1
                stats.live += 1
                episodes.start_soon(one_episode, spec)

    async def follow_versions(stop_admitting: anyio.CancelScope) -> None:
        async for _, messages in sub:
            for message in messages:
                if isinstance(message, PolicyVersion):
                    gate.update(message)
            if gate.final:
                stop_admitting.cancel()

    metrics = MetricsWriter(Path(cfg.run.dir) / f"envpool-{name}.jsonl") if cfg.run.dir \
        else NullMetrics()

    def snapshot() -> None:
        """One statistics record; the latency histogram covers the interval since the last."""
        metrics.write({
            "worker": name, "started": stats.started, "finished": stats.finished,
            "failed": dict(stats.failed), "live": stats.live, "groups": stats.groups,
            "rss_bytes": rss_bytes(), "turns": client.stats.completed,
            "turn_latency": client.take_latency().to_dict(), "gate": gate.statistics(),
            "client": client.statistics(),
            "actor_socket": dealer.statistics().counters(),
            "learner_socket": push.statistics().counters(),
        })

    async def record_stats() -> None:
        while True:
            snapshot()
            await anyio.sleep(pool.stats_every_s)

    async def progress(every_s: float = 10.0) -> None:
        while True:
            await anyio.sleep(every_s)
            # A short line; the full statistics go to envpool-<name>.jsonl (snapshot above).
            log.info("%s started=%d finished=%d failed=%s live=%d gate=%s", name, stats.started,
                     stats.finished, dict(stats.failed), stats.live, gate.statistics())

    async with anyio.create_task_group() as io:
        for channel in (dealer, sub, push):
            io.start_soon(channel.run)
        io.start_soon(client.run)
        io.start_soon(progress)
        io.start_soon(record_stats)
        if ready_file:
            Path(ready_file).write_text(json.dumps({"worker": name}))
        log.info("%s running %s, waiting for the learner's first version", name, pool.env)
        with anyio.CancelScope() as admitting:
            io.start_soon(follow_versions, admitting)
            async with anyio.create_task_group() as episodes:
                await admit_groups(episodes)
                episodes.cancel_scope.cancel()  # final: the unfinished episodes end as run_ended
        await push.send(PoolDone(name, stats.started, stats.finished, sum(stats.failed.values())))
        flushed = await push.flush(timeout=30.0)
        snapshot()
        metrics.close()
        log.info("%s done: started=%d finished=%d failed=%s flushed=%s", name, stats.started,
                 stats.finished, dict(stats.failed), flushed)
        io.cancel_scope.cancel()
    return stats


def main(argv: list[str] | None = None) -> None:
    from millstream.shared.runtime import raise_fd_limit, role_args

    cfg, ns = role_args("envpool", argv)
    raise_fd_limit()
    started = time.monotonic()
    stats = anyio.run(run_worker, cfg, ns.worker_index, ns.ready_file, backend="trio")
    log.info("envpool exited after %.1fs: %s", time.monotonic() - started, stats)

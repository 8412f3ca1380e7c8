"""An envpool worker: admits groups of episodes and runs them all as tasks on one event loop.

    millstream envpool [--config run.toml] [--worker-index I]

Sockets: one DEALER per actor replica (every episode's requests, multiplexed, routed by
envpool/actors/router.py among the replicas the learner announces), one SUB for the
learner's `PolicyVersion`s (they drive the admission gate), one PUSH of `Trajectory` /
`EpisodeFailed` and the worker's bookkeeping to the learner, fed in order by one task
(envpool/outbox.py).

Life of a worker: wait for the learner's first version; make sure the actor answers (`Hello`,
bounded retries); then, as long as the gate allows and
capacity (`envpool.max_concurrent_episodes`) remains, start the next group: `group_size` episodes
with the same environment seed. When the learner announces `final`, stop admitting, cancel the
episodes still running (each is reported as failed with cause `run_ended`, so nothing is lost),
send `PoolDone` with this worker's totals, and exit.

With `eval.every` > 0, worker 0 also plays evaluation rounds (envpool/scoring/evaluator.py), never
trained and outside this accounting; the final version's round is played before `PoolDone`.

Accounting is exact by construction: every started episode sends exactly one message to the
learner, a trajectory or a failure.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import trio
from anyio.abc import TaskGroup

from millstream.envpool.actors.generation import Sampling
from millstream.envpool.actors.router import Router
from millstream.envpool.agents.episode import is_agent_env, run_agent_episode
from millstream.envpool.chat import ChatFormat, tokenizer_dir
from millstream.envpool.envs import make_env
from millstream.envpool.episode import EpisodeSpec, run_episode
from millstream.envpool.gate import AdmissionGate
from millstream.envpool.heap import Heap
from millstream.envpool.lineage import Lineage
from millstream.envpool.outbox import Outbox
from millstream.envpool.record import episode_failed
from millstream.envpool.redelivery import Unsettled
from millstream.envpool.scoring.evaluator import Evaluator
from millstream.envpool.scoring.judge import Judge
from millstream.envpool.seeds import group_seed, sampling_seed
from millstream.envpool.stats import WorkerStats, rss_bytes
from millstream.shared.config import Config
from millstream.shared.obs.metrics import MetricsWriter, NullMetrics
from millstream.shared.wire import (
    Cause,
    EpisodeFailed,
    GroupStarted,
    PolicyVersion,
    PoolDone,
    Trajectory,
    WorkerHello,
    group_id,
    member_id,
)
from millstream.shared.wire.keys import load_keys
from millstream.shared.wire.transport import open_channel

if TYPE_CHECKING:
    from millstream.envpool.agents.endpoint import Endpoint

__all__ = ["run_worker", "Worker", "ActorUnavailable"]

log = logging.getLogger("envpool")


class ActorUnavailable(RuntimeError):
    """Too many episodes in a row failed on the actor's side: stop instead of burning episodes."""


class Worker:
    """One worker's sockets, state and steps; `run()` plays until the learner is final.

    The steps, in the order a run meets them: `_admit_groups` (wait for the gate, greet the
    actor once, start each group's episodes), `_episode` (play one, count it, report it),
    `_follow_versions` (feed the gate), `_record_stats` / `_progress` (statistics), `_finish`
    (PoolDone, flush).
    """

    def __init__(self, cfg: Config, worker_index: int = 0, actor_address: str | None = None) -> None:
        pool = cfg.envpool
        probe = make_env(pool.env, pool.env_args)  # fail fast on a bad name or bad arguments
        self.cfg, self.pool = cfg, pool
        self.name = f"w{worker_index}"
        self.chat = ChatFormat.from_model_dir(tokenizer_dir(cfg))
        #: How every turn of this worker's episodes is sampled: built once, passed down.
        self.sampling = Sampling.for_turns(pool, self.chat.stop_token_ids)
        self.actor_address = actor_address or cfg.actor.connect or cfg.actor.address
        keys = load_keys(cfg, "envpool", worker=worker_index)  # its own: the learner checks it
        self.sub = open_channel("sub", cfg.learner.version_address, bind=False, cfg=cfg.transport, keys=keys)
        self.push = open_channel(
            "push", cfg.learner.experience_address, bind=False, cfg=cfg.transport, keys=keys
        )
        self.client = Router(cfg.transport, self.name, keys, self.actor_address)
        #: The frozen judge that scores finished episodes (judge.model_path), or None.
        self.judge = Judge(cfg, self.name, keys) if cfg.judge.model_path else None
        #: Agent environments talk to an OpenAI-compatible endpoint per episode (loopback).
        self.endpoint: Endpoint | None = None
        if is_agent_env(probe):
            from millstream.envpool.agents.endpoint import (
                Endpoint,  # the agents extra: only agent runs need it
            )

            self.endpoint = Endpoint(self.chat, self.client, pool, lambda: self.max_model_len)
        self.index = worker_index
        #: This process; a restarted worker (same index) is a new incarnation.
        self.incarnation = uuid.uuid4().hex[:12]
        #: Episodes running now (their ids), for the hello to a restarted learner.
        self.live_ids: set[str] = set()
        #: What this process announced, in a file its successor reads; what its predecessors did.
        self.lineage = Lineage.open(
            Path(cfg.run.dir) / f"envpool-w{worker_index}.lineage" if cfg.run.dir else None, self.incarnation
        )
        self.gate = AdmissionGate(
            worker_index=worker_index, workers=pool.workers, numbered_past=self.lineage.numbered_past
        )
        #: Pushed results no learner checkpoint holds yet, for a restarted learner.
        self.unsettled = Unsettled(worker_index, self.incarnation, int(pool.redeliver_mib * 2**20))
        #: Results and bookkeeping for the learner, sent in order (envpool/outbox.py).
        self.outbox = Outbox(self.push, self.unsettled, size=pool.max_concurrent_episodes + 64)
        self.stats = WorkerStats()
        #: The context episodes are cut to: the config's, or the actor's own if it is smaller
        #: (an actor started by hand may hold a shorter one); set again after the handshake.
        self.max_model_len = cfg.actor.max_model_len
        self.slots = anyio.Semaphore(pool.max_concurrent_episodes)
        self.heap = Heap(pool.gc_full_every_s)
        self.starting = anyio.CapacityLimiter(pool.max_starting_envs)
        #: Evaluation rounds (envpool/scoring/evaluator.py): worker 0 plays them, when `eval.every` > 0.
        self.evaluator = (
            Evaluator(cfg, self.name, self.chat, self.client, self.push.send, lambda: self.max_model_len)
            if cfg.eval.every > 0 and worker_index == 0
            else None
        )
        self.metrics: MetricsWriter | NullMetrics = (
            MetricsWriter(Path(cfg.run.dir) / f"envpool-{self.name}.jsonl") if cfg.run.dir else NullMetrics()
        )

    async def run(self, ready_file: str | None = None) -> WorkerStats:
        """The worker until the learner's last version; on trio only (its episodes run on a trio
        nursery, and `millstream envpool` runs it on trio)."""
        self.heap.settle()
        try:
            async with anyio.create_task_group() as io:
                await self._serve(io, ready_file)
                io.cancel_scope.cancel()
        finally:
            self.heap.restore()
            self.lineage.close()
        return self.stats

    async def _serve(self, io: TaskGroup, ready_file: str | None) -> None:
        """Start the worker's own tasks in `io`, play episodes until the learner's last version,
        then finish (evaluation, the final report)."""
        for channel in (self.sub, self.push):
            io.start_soon(channel.run)
        io.start_soon(self.outbox.run)
        io.start_soon(self.client.run)
        if self.judge is not None:
            io.start_soon(self.judge.run)
        io.start_soon(self._progress)
        io.start_soon(self._record_stats)
        io.start_soon(self.heap.run)
        if self.evaluator is not None:
            io.start_soon(self.evaluator.run)
        if self.endpoint is not None:
            await io.start(self.endpoint.serve)
        if ready_file:
            Path(ready_file).write_text(f'{{"worker": "{self.name}"}}')
        log.info("%s running %s, waiting for the learner's first version", self.name, self.pool.env)
        with anyio.CancelScope() as admitting:
            io.start_soon(self._follow_versions, admitting)
            # Episodes go on trio's own nursery: anyio's task group gives each task a handle
            # with a cancel scope and an event of its own (anyio >= 4.14), which at 10,000
            # live episodes is memory and CPU for nothing the worker uses.
            async with trio.open_nursery() as episodes:
                await self._admit_groups(episodes)
                episodes.cancel_scope.cancel()  # final: unfinished episodes end as run_ended
        if self.evaluator is not None and self.gate.version is not None:
            await self.evaluator.finish(self.gate.version)  # bounded by eval.timeout_s
        await self._finish()

    # --- admission ---------------------------------------------------------------------------

    async def _admit_groups(self, episodes: trio.Nursery) -> None:
        greeted = False
        while True:
            number = await self.gate.admit(self.pool.start_timeout_s, self.pool.learner_silence_timeout_s)
            if number is None:
                return
            if not greeted:
                # Only now: the learner announces its first version after the actor took its
                # weights, so an actor still loading (a minute for vLLM) is not taken for gone.
                await self._greet_actor()
                greeted = True
            await self._take_slots(self.cfg.train.group_size)
            # Announced before any member runs: if this process dies, the learner still knows
            # every episode it started; and counted in the lineage file before they run, for
            # an announcement that dies in the queues with this process (envpool/lineage.py).
            size = self.cfg.train.group_size
            await self.outbox.put(GroupStarted(self.index, self.incarnation, group_id(number), size))
            self.lineage.announce(size, number)
            self._start_group(episodes, number)

    async def _greet_actor(self) -> None:
        pool = self.pool
        info = await self.client.handshake(
            timeout_s=pool.actor_connect_timeout_s,
            retries=pool.actor_retries,
            backoff_s=pool.actor_retry_backoff_s,
        )
        log.info(
            "%s: actor at %s serves %s (version %d)", self.name, self.actor_address, info.model, info.version
        )
        if info.max_model_len < self.max_model_len:
            log.warning(
                "%s: the actor's context is %d tokens, actor.max_model_len says %d: episodes are "
                "cut to the actor's",
                self.name,
                info.max_model_len,
                self.max_model_len,
            )
            self.max_model_len = info.max_model_len

    async def _take_slots(self, n: int) -> None:
        for _ in range(n):
            try:  # the free-slot case must not wait a scheduler round per slot: at 10,000
                self.slots.acquire_nowait()  # episodes that alone made filling the pool take 8 s
            except anyio.WouldBlock:
                await self.slots.acquire()

    def _start_group(self, episodes: trio.Nursery, number: int) -> None:
        size = self.cfg.train.group_size
        seed = group_seed(self.cfg.run.seed, number)
        gid = group_id(number)
        self.stats.groups += 1
        for member in range(size):
            spec = EpisodeSpec(member_id(gid, member), gid, seed, member, size, self.pool.env)
            self.live_ids.add(spec.episode_id)
            self.stats.started += 1
            self.stats.live += 1
            episodes.start_soon(self._episode, spec, name="episode")  # a name, not one made per task

    async def _follow_versions(self, stop_admitting: anyio.CancelScope) -> None:
        async for _, messages in self.sub:
            for message in messages:
                if isinstance(message, PolicyVersion):
                    if message.session != self.gate.session:
                        await self._say_hello(message)
                    self.unsettled.hear(message)
                    self.gate.update(message)
                    self.client.update(message.replicas)
                    if self.evaluator is not None and not message.final:
                        self.evaluator.notice(message.version)
            if self.gate.final:
                stop_admitting.cancel()

    async def _say_hello(self, first: PolicyVersion) -> None:
        """Introduce this process to a new learner session (the first, or a restarted one): what
        it started and reported so far, what still runs, where its numbering stands; first, what
        that session's checkpoint lacks, pushed again (envpool/redelivery.py)."""
        log.info("%s: learner session %s, saying hello", self.name, first.session or "(unnamed)")

        def hello() -> WorkerHello:  # `reported` is filled in as it is sent (envpool/outbox.py)
            # Before its first group: past its predecessors' (the learner may not know them all).
            numbered = self.gate.group_base is not None
            next_group = self.gate.next_group if numbered else self.lineage.numbered_past
            live = sorted(self.live_ids)
            return WorkerHello(
                self.index,
                self.incarnation,
                self.stats.started,
                live=live,
                next_group=next_group,
                lineage=self.lineage.predecessors,
            )

        again = await self.outbox.greet(first, hello)
        if again:
            log.info("%s: pushed %d results again to learner session %s", self.name, again, first.session)

    # --- one episode -------------------------------------------------------------------------

    async def _episode(self, spec: EpisodeSpec) -> None:
        """Play one episode; whatever happens, count it and report exactly one result."""
        result: Trajectory | EpisodeFailed | None = None
        try:
            env = make_env(self.pool.env, self.pool.env_args)
            if self.endpoint is not None:
                result = await run_agent_episode(spec, env, self.endpoint, self.pool)
            else:
                result = await run_episode(
                    spec,
                    env,
                    self.chat,
                    self.client,
                    self.pool,
                    self.max_model_len,
                    self.starting,
                    sampling=self.sampling,
                    deadlines=self.client.deadlines,
                )
            if self.judge is not None and isinstance(result, Trajectory):
                result = await self.judge.score(result, sampling_seed(spec.seed, spec.member, -1))
        except Exception as exc:  # a bug of ours must still not lose the episode
            log.exception("episode %s crashed", spec.episode_id)
            result = EpisodeFailed(
                spec.episode_id,
                spec.group_id,
                spec.group_size,
                Cause.ENVPOOL_ERROR,
                f"{type(exc).__name__}: {exc}"[:500],
            )
        finally:  # cancellation (the run ended) lands here without a result
            if result is None:
                result = episode_failed(
                    spec,
                    Cause.RUN_ENDED,
                    "the learner finished (or the worker stopped) while this episode ran",
                )
            self.stats.settle(result)
            self.live_ids.discard(spec.episode_id)
            self.client.release(spec.episode_id)
            self.slots.release()
            try:  # the common case, room in the queue, needs no scope
                self.outbox.put_nowait(result)
            except anyio.WouldBlock:
                with anyio.CancelScope(shield=True):  # a cancelled episode still reports its end
                    await self.outbox.put(result)
        streak = self.stats.actor_failure_streak
        if streak > self.pool.max_consecutive_actor_failures and isinstance(result, EpisodeFailed):
            raise ActorUnavailable(
                f"{streak} episodes in a row failed on the actor's side, the "
                f"last with {result.cause}: {result.message}"
            )

    # --- statistics and the end --------------------------------------------------------------

    def _snapshot(self) -> None:
        """One statistics record; the latency histogram covers the interval since the last."""
        stats, client = self.stats, self.client
        self.metrics.write(
            {
                "worker": self.name,
                "started": stats.started,
                "finished": stats.finished,
                "failed": {str(k): v for k, v in stats.failed.items()},
                "live": stats.live,
                "groups": stats.groups,
                "rss_bytes": rss_bytes(),
                "turns": client.completed,
                "turn_latency": client.take_latency().to_dict(),
                "gate": self.gate.statistics(),
                "client": client.statistics(),
                "actor_socket": client.socket_counters(),
                **({"judge": self.judge.statistics()} if self.judge is not None else {}),
                "learner_socket": self.push.statistics().counters(),
                "gc": self.heap.statistics(),
                "redelivery": self.unsettled.statistics(),
                "outbox": self.outbox.statistics(),
            }
        )

    async def _record_stats(self) -> None:
        while True:
            self._snapshot()
            await anyio.sleep(self.pool.stats_every_s)

    async def _progress(self, every_s: float = 10.0) -> None:
        while True:
            await anyio.sleep(every_s)
            # A short line; the full statistics go to envpool-<name>.jsonl (_snapshot).
            stats = self.stats
            log.info(
                "%s started=%d finished=%d failed=%s live=%d gate=%s",
                self.name,
                stats.started,
                stats.finished,
                dict(stats.failed),
                stats.live,
                self.gate.statistics(),
            )

    async def _finish(self) -> None:
        stats = self.stats
        done = PoolDone(self.name, stats.started, stats.finished, sum(stats.failed.values()))
        flushed = await self.outbox.close(done, timeout_s=30.0) and await self.push.flush(timeout=30.0)
        self._snapshot()
        self.metrics.close()
        log.info(
            "%s done: started=%d finished=%d failed=%s flushed=%s",
            self.name,
            stats.started,
            stats.finished,
            dict(stats.failed),
            flushed,
        )


async def run_worker(
    cfg: Config,
    worker_index: int = 0,
    ready_file: str | None = None,
    actor_address: str | None = None,
    stats_hook: Callable[[WorkerStats], Any] | None = None,
) -> WorkerStats:
    """Run one worker until the learner is final; `stats_hook` receives the live stats object."""
    worker = Worker(cfg, worker_index, actor_address)
    if stats_hook is not None:
        stats_hook(worker.stats)
    return await worker.run(ready_file)

"""The learner process: receive episodes, train on complete groups, push weights, announce.

    millstream learner [--config run.toml] actor.connect=tcp://... run.dir=runs/x

One loop, synchronous on purpose (training is the slow part; ZeroMQ queues arriving experience in
its own I/O thread meanwhile):

1. attach to the actor and push the initial weights as version 0 (or the resumed version), so the
   actor never generates for this session with weights the learner does not have;
2. drain arriving `Trajectory` / `EpisodeFailed` messages into the replay buffer;
3. when `groups_per_batch` fresh groups are complete: GRPO advantages, one optimizer step,
   push the new weights, announce the new version (the envpool gate paces admission by it);
4. after `train.steps` steps: announce `final`, collect every worker's `PoolDone`, count what is
   left in the buffer as dropped ("run_ended"), check the accounting identity, save the weights.

The version is also re-announced every second (a heartbeat): PUB/SUB drops messages sent before a
subscriber connects, and the envpool uses the silence of a dead learner as its error signal.

Standard output carries one progress line per step and nothing else (logs go to stderr), so the
launcher can show it as is.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import msgspec
import orjson
import zmq

from shared.config import Config
from shared.metrics import MetricsWriter
from shared.protocol import (
    Codec,
    EpisodeFailed,
    PolicyVersion,
    PoolDone,
    ProtocolError,
    Trajectory,
    admit_limit,
)
from shared.runtime import resolve_model_dir, role_args, write_ready

from .advantages import grpo_advantages
from .replay import ReplayBuffer
from .stats import batch_metrics, progress_line
from .trainer import Trainer, TrainSample
from .weights import WeightSender

__all__ = ["run_learner", "main"]

log = logging.getLogger("learner")


class Experience:
    """The learner's sockets: PULL for episodes, PUB for versions."""

    def __init__(self, cfg: Config) -> None:
        ctx = zmq.Context.instance()
        self.codec = Codec()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, cfg.transport.high_water_mark)
        self.pull.bind(cfg.learner.experience_address)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(cfg.learner.version_address)
        self.last_announce = 0.0

    def announce(self, version: int, limit: int, group_base: int, final: bool = False) -> None:
        self.pub.send(self.codec.encode([PolicyVersion(version, limit, group_base, final)]))
        self.last_announce = time.monotonic()

    def receive(self, timeout_s: float):
        """Yield the messages that arrive within `timeout_s` (all that are queued, at least)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if not self.pull.poll(max(0, int(left * 1000))):
                return
            try:
                yield from self.codec.decode(self.pull.recv())
            except ProtocolError as exc:  # counted in codec.errors; a PULL cannot answer
                log.error("dropped a bad experience frame: %s", exc)

    def close(self) -> None:
        self.pull.close(linger=0)
        self.pub.close(linger=0)


def run_learner(cfg: Config, ready_file: str | None = None) -> dict:
    run_dir = Path(cfg.run.dir or f"{cfg.run.root}/{cfg.run.name}-learner")
    run_dir.mkdir(parents=True, exist_ok=True)
    actor_address = cfg.actor.connect or cfg.actor.address
    model_dir = resolve_model_dir(cfg)
    train = cfg.train

    trainer = Trainer(model_dir, cfg.learner, seed=cfg.run.seed, dtype="float32")
    sync = WeightSender(actor_address, cfg.learner, dtype=cfg.model.dtype)
    sync.attach()
    sync_metrics = sync.push(trainer.named_weights(), trainer.version)
    log.info("initial weights pushed as version %d in %.2fs", trainer.version, sync_metrics["sync/total_s"])

    exp = Experience(cfg)
    buffer = ReplayBuffer(train.group_size, train.groups_per_batch, train.max_staleness,
                          cfg.learner.max_buffer_groups)
    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    episodes_log = (run_dir / "trajectories.jsonl").open("ab")
    done_workers: dict[str, PoolDone] = {}
    write_ready(ready_file, experience=cfg.learner.experience_address,
                versions=cfg.learner.version_address)

    def handle(message) -> None:
        if isinstance(message, Trajectory):
            buffer.add(message)
        elif isinstance(message, EpisodeFailed):
            buffer.fail(message)
            episodes_log.write(orjson.dumps({"fate": f"failed:{message.cause}", **_msg(message)},
                                            option=orjson.OPT_APPEND_NEWLINE))
        elif isinstance(message, PoolDone):
            done_workers[message.worker] = message
        else:
            log.warning("unexpected %s on the experience socket", type(message).__name__)

    group_base = carried = 0  # a resumed session sets both (learner/checkpoint.py)
    trained_groups = 0

    def limit() -> int:
        return admit_limit(group_base=group_base, consumed=trained_groups + buffer.dropped_groups,
                           carried=carried, groups_per_batch=train.groups_per_batch,
                           max_staleness=train.max_staleness, slack=cfg.envpool.admission_slack)

    started = last_step = last_data = time.monotonic()
    announced = limit()
    exp.announce(trainer.version, announced, group_base)
    while trainer.version < train.steps:
        for message in exp.receive(0.05):
            handle(message)
            last_data = time.monotonic()
        batch = buffer.take_batch(trainer.version)
        if time.monotonic() - exp.last_announce > 1.0 or limit() != announced:
            announced = limit()
            exp.announce(trainer.version, announced, group_base)
        if batch is None:
            if time.monotonic() - last_data > cfg.learner.idle_timeout_s:
                raise TimeoutError(f"no experience for {cfg.learner.idle_timeout_s}s; is the envpool alive? "
                                   f"buffer: {buffer.statistics()}")
            continue
        version = trainer.version
        scored = [(traj, adv) for group in batch
                  for traj, adv in zip(group.trajectories,
                                       grpo_advantages([t.reward for t in group.trajectories]))]
        samples = [TrainSample(t.token_ids, t.loss_mask, t.logprobs, [adv] * len(t.token_ids))
                   for t, adv in scored]
        step_metrics = trainer.train_step(samples, clip_low=cfg.learner.clip_low,
                                          clip_high=cfg.learner.clip_high)
        sync_metrics = sync.push(trainer.named_weights(), trainer.version)
        trained_groups += len(batch)
        announced = limit()
        exp.announce(trainer.version, announced, group_base)
        now = time.monotonic()
        record = {"step": trainer.version, "trained_version": version,
                  **batch_metrics(batch, version, now - last_step, now - started),
                  **{f"train/{k}": v for k, v in step_metrics.items()},
                  **sync_metrics, **_buffer_metrics(buffer)}
        metrics.write(record)
        print(progress_line(record, train.steps), flush=True)
        for traj, adv in scored:
            episodes_log.write(orjson.dumps(
                {"fate": "trained", "step": trainer.version, "trained_version": version,
                 "advantage": adv, **_msg(traj)}, option=orjson.OPT_APPEND_NEWLINE))
        last_step = now

    summary = _finish(cfg, exp, buffer, done_workers, handle, group_base)
    trainer.save_pretrained(str(run_dir / "final"))
    summary["final_weights"] = str(run_dir / "final")
    summary["decode_errors"] = exp.codec.errors
    metrics.write({"summary": summary})
    (run_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    episodes_log.close()
    metrics.close()
    sync.close()
    exp.close()
    return summary


def _finish(cfg: Config, exp: Experience, buffer: ReplayBuffer, done_workers: dict, handle,
            group_base: int) -> dict:
    """Tell the workers to stop, collect their totals, account for every episode."""
    deadline = time.monotonic() + cfg.envpool.step_timeout_s + 60
    while len(done_workers) < cfg.envpool.workers and time.monotonic() < deadline:
        exp.announce(cfg.train.steps, 0, group_base, final=True)
        for message in exp.receive(0.2):
            handle(message)
    buffer.drain("run_ended")
    stats = buffer.statistics()
    started = sum(d.episodes_started for d in done_workers.values())
    accounted = stats["trained"] + sum(stats["dropped"].values()) + sum(stats["failed"].values())
    summary = {
        "workers_done": len(done_workers),
        "episodes_started": started,
        "episodes_trained": stats["trained"],
        "episodes_dropped": stats["dropped"],
        "episodes_failed": stats["failed"],
        "duplicates": stats["duplicates"],
        "accounting_ok": len(done_workers) == cfg.envpool.workers and started == accounted,
    }
    if not summary["accounting_ok"]:
        log.error("accounting does not add up: %s", summary)
    return summary


def _buffer_metrics(buffer: ReplayBuffer) -> dict:
    stats = buffer.statistics()
    out = {"episodes/received": stats["received"], "episodes/trained": stats["trained"],
           "episodes/buffered": stats["buffered"], "groups/dropped": buffer.dropped_groups}
    out.update({f"episodes/dropped/{k}": v for k, v in stats["dropped"].items()})
    out.update({f"episodes/failed/{k}": v for k, v in stats["failed"].items()})
    return out


def _msg(message) -> dict:
    return msgspec.structs.asdict(message)


def main(argv: list[str] | None = None) -> None:
    cfg, ns = role_args("learner", argv)
    summary = run_learner(cfg, ns.ready_file)
    log.info("learner finished: %s", summary)
    sys.exit(0 if summary["accounting_ok"] else 3)


if __name__ == "__main__":
    main()

"""Replay recorded episodes against two policies and show where their behaviours part.

    millstream debug RUN_DIR --replay --against CKPT_A CKPT_B [--episodes 20 | --episode ROW]

Each side is a checkpoint (its hf/ export), a model directory, or a running actor's address
(tcp://...). The episodes come from the run's trajectory store; each is played again from its
seed (same environment, same task) against side A, then against side B, greedily by default
(`--temperature 0`), so a difference is the weights' doing, not sampling's. For each episode the
first turn whose reply differs is printed with both replies, then a summary. One actor runs at a
time (this machine has room for one engine).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import anyio
import msgspec

from millstream.envpool.actors.client import ActorClient
from millstream.envpool.chat import ChatFormat
from millstream.envpool.debug.actor import actor_for_checkpoint
from millstream.envpool.debug.engine import DebugEpisode
from millstream.envpool.envs import make_env
from millstream.shared.config import Config, ConfigError
from millstream.shared.store.trajstore import open_store
from millstream.shared.wire.keys import load_keys
from millstream.shared.wire.transport import open_channel

__all__ = ["replay_against", "first_parting"]


def first_parting(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token index) where two episodes' replies first differ, or None if they never do."""
    for turn, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            index = next(
                (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
            )
            return turn, index
    if len(a) != len(b):
        return min(len(a), len(b)), 0
    return None


def _episodes(store: Path, row: str | None, count: int) -> list[dict[str, Any]]:
    db = open_store(store, readonly=True)
    try:
        if row is not None:
            rows = db.execute("SELECT id, env, seed FROM episodes WHERE id = ?", (int(row),)).fetchall()
        else:
            rows = db.execute(
                "SELECT id, env, seed FROM episodes WHERE fate IN ('trained', 'debug') AND rolled_back = 0 "
                "ORDER BY id DESC LIMIT ?",
                (count,),
            ).fetchall()
    finally:
        db.close()
    if not rows:
        raise ConfigError(f"no recorded episode to replay in {store}")
    return [dict(r) for r in rows]


async def _play_all(
    cfg: Config, address: str, chat: ChatFormat, episodes: list[dict[str, Any]]
) -> list[list[Any]]:
    """Every episode against the actor at `address`: per episode, per turn (ids, text)."""
    channel = open_channel("dealer", address, bind=False, cfg=cfg.transport, keys=load_keys(cfg, "envpool"))
    client = ActorClient(channel, "replay")
    played = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(channel.run)
        tg.start_soon(client.run)
        for ep in episodes:
            args = cfg.envpool.env_args if ep["env"] == cfg.envpool.env else {}
            run = DebugEpisode(
                lambda ep=ep, args=args: make_env(ep["env"], args), ep["seed"], chat, client, cfg.envpool
            )
            await run.start()
            while run.stop not in ("done", "failed"):
                await run.advance()
            played.append([(t.reply_ids, t.reply) for t in run.turns])
        tg.cancel_scope.cancel()
    return played


def _side(target: str, cfg: Config) -> contextlib.AbstractContextManager[str]:
    if target.startswith("tcp://"):
        return contextlib.nullcontext(target)
    return actor_for_checkpoint(Path(target), cfg)


def replay_against(
    cfg: Config,
    chat: ChatFormat,
    store: Path,
    sides: list[str],
    row: str | None,
    count: int,
    temperature: float,
) -> dict[str, Any]:
    """Play the episodes against both sides; print and return where they part."""
    cfg = msgspec.structs.replace(cfg, envpool=msgspec.structs.replace(cfg.envpool, temperature=temperature))
    episodes = _episodes(store, row, count)
    results = []
    for side in sides:
        with _side(side, cfg) as address:
            print(f"replaying {len(episodes)} episodes against {side} ({address})", flush=True)
            results.append(anyio.run(_play_all, cfg, address, chat, episodes, backend="trio"))
    parted = []
    for ep, a, b in zip(episodes, results[0], results[1], strict=True):
        where = first_parting([ids for ids, _ in a], [ids for ids, _ in b])
        if where is None:
            print(f"row {ep['id']} ({ep['env']} seed {ep['seed']}): the same in all {len(a)} turns")
            continue
        turn, token = where
        text_a = a[turn][1] if turn < len(a) else "(no such turn)"
        text_b = b[turn][1] if turn < len(b) else "(no such turn)"
        print(f"row {ep['id']} ({ep['env']} seed {ep['seed']}): parts at turn {turn}, token {token}")
        print(f"   A: {text_a!r}\n   B: {text_b!r}")
        parted.append({"row": ep["id"], "turn": turn, "token": token, "a": text_a, "b": text_b})
    print(f"{len(parted)} of {len(episodes)} episodes part; {len(episodes) - len(parted)} are the same")
    return {"episodes": len(episodes), "parted": parted}

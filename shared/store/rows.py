"""The rows of the trajectory store (shared/store/trajstore.py) and how protocol messages become rows.

Token arrays are stored as little-endian blobs: ids and versions int32, logprobs and advantages
float32, the loss mask uint8 (about 13 bytes a token, against 17 in JSON lines).
`Trajectory.texts` alternates observation, response, observation, ...: turn t's observation is
texts[2t] and its response texts[2t + 1].
"""

from __future__ import annotations

import array
from typing import Any

import msgspec

from millstream.shared.wire import EpisodeFailed, Scene, Trajectory

__all__ = [
    "EpisodeRow",
    "TurnRow",
    "RequestRow",
    "episode_from_trajectory",
    "episode_from_failure",
    "ints",
    "floats",
    "pack_ints",
    "pack_floats",
]


class TurnRow(msgspec.Struct, frozen=True):
    turn: int
    request_id: str | None
    start: int
    end: int
    reward: float | None
    observation: str
    response: str


class RequestRow(msgspec.Struct, frozen=True):
    request_id: str
    turn: int
    status: str
    error: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


class EpisodeRow(msgspec.Struct):
    """One episode as the store holds it (what `write_episode` inserts)."""

    episode_id: str
    group_id: str
    env: str
    seed: int
    fate: str
    step: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[TurnRow]
    cause: str | None = None
    message: str | None = None
    reward: float | None = None
    success: bool | None = None
    truncated: str | None = None
    trained_version: int | None = None
    duration_s: float | None = None
    advantages: list[float] | None = None
    requests: list[RequestRow] = []
    fork_of: int | None = None
    fork_turn: int | None = None
    note: str | None = None
    extra: dict[str, Any] = {}
    created: float = 0.0


def pack_ints(values: list[int]) -> bytes:
    return array.array("i", values).tobytes()


def pack_floats(values: list[float]) -> bytes:
    return array.array("f", values).tobytes()


def ints(blob: bytes | None) -> list[int]:
    return array.array("i", blob or b"").tolist()


def floats(blob: bytes | None) -> list[float]:
    return array.array("f", blob or b"").tolist()


def _turn_rows(
    texts: list[str], starts: list[int], ends: list[int], rewards: list[float], request_ids: list[str]
) -> list[TurnRow]:
    """`texts` alternates observation, response, observation, ... (Trajectory.texts)."""
    return [
        TurnRow(
            turn=t,
            request_id=request_ids[t] if t < len(request_ids) else None,
            start=start,
            end=end,
            reward=rewards[t] if t < len(rewards) else None,
            observation=texts[2 * t] if 2 * t < len(texts) else "",
            response=texts[2 * t + 1] if 2 * t + 1 < len(texts) else "",
        )
        for t, (start, end) in enumerate(zip(starts, ends, strict=False))
    ]


def episode_from_trajectory(
    traj: Trajectory,
    *,
    fate: str,
    step: int,
    cause: str | None = None,
    trained_version: int | None = None,
    advantages: list[float] | None = None,
) -> EpisodeRow:
    """A trained (or dropped: `fate="dropped"`, `cause` its drop cause) episode."""
    return EpisodeRow(
        episode_id=traj.episode_id,
        group_id=traj.group_id,
        env=traj.env,
        seed=traj.seed,
        fate=fate,
        step=step,
        cause=cause,
        token_ids=traj.token_ids,
        loss_mask=traj.loss_mask,
        logprobs=traj.logprobs,
        versions=traj.versions,
        turns=_turn_rows(traj.texts, traj.turn_starts, traj.turn_ends, traj.turn_rewards, traj.request_ids),
        reward=traj.reward,
        success=traj.success,
        truncated=None if traj.truncated is None else str(traj.truncated),
        trained_version=trained_version,
        duration_s=traj.duration_s,
        advantages=advantages,
        extra={
            "segment_starts": traj.segment_starts,
            "anchors": traj.anchors,
            "invalid_actions": traj.invalid_actions,
            "group_size": traj.group_size,
            "final_observation": traj.texts[-1] if len(traj.texts) % 2 == 1 and traj.texts else "",
        },
    )


def episode_from_failure(failed: EpisodeFailed, *, step: int, env: str = "") -> EpisodeRow:
    """A failed episode, with its scene when the envpool sent one."""
    scene: Scene | None = failed.scene
    requests: list[RequestRow] = []
    if scene is not None and scene.request is not None:
        r = scene.request
        requests.append(
            RequestRow(r.request_id, r.turn, "failed", r.error, r.token_ids, r.logprobs, r.versions)
        )
    return EpisodeRow(
        episode_id=failed.episode_id,
        group_id=failed.group_id,
        env=scene.env if scene else env,
        seed=scene.seed if scene else -1,
        fate="failed",
        step=step,
        cause=str(failed.cause),
        message=failed.message,
        token_ids=scene.token_ids if scene else [],
        loss_mask=scene.loss_mask if scene else [],
        logprobs=scene.logprobs if scene else [],
        versions=scene.versions if scene else [],
        turns=_turn_rows(
            scene.texts, scene.turn_starts, scene.turn_ends, scene.turn_rewards, scene.request_ids
        )
        if scene
        else [],
        duration_s=scene.duration_s if scene else None,
        requests=requests,
        extra={"group_size": failed.group_size, "scene": scene is not None},
    )

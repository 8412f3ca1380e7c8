"""The trajectory store: every episode of a run in one SQLite file, `RUN_DIR/store.sqlite`.

    writer = StoreWriter(run_dir / STORE_FILE, keep_success=1.0, max_mb=2048)   # shared/store/writer.py
    writer.put(episode_from_trajectory(traj, fate="trained", step=7, advantages=adv))
    writer.put(episode_from_failure(failed, step=7))
    ...
    writer.close()

    store = open_store(run_dir / STORE_FILE, readonly=True)
    rows = find_episodes(store, cause="env_timeout", limit=20)
    one = load_episode(store, rows[0]["id"])          # its tokens, turns and the failed request

This module is the database: its tables, opening it, writing one episode, reading episodes
back, and the marks a resume leaves. The learner writes through `StoreWriter`
(shared/store/writer.py: its own thread, a bounded queue, retention and a size cap); the tools
read with the functions here (`millstream inspect`, shared/inspect/).

Why SQLite: a real database with indexes and no server; WAL mode lets readers (`millstream
inspect`, the web page) query a live run while the learner writes. One file per run, next to
`metrics.jsonl`.

Layout (one row per thing; token arrays as little-endian blobs: ids and versions int32,
logprobs and advantages float32, loss mask uint8 - about 13 bytes a token):
- `episodes`: one per trained, dropped, failed or forked episode; `id` is the write order
  (a resume marks rows after its checkpoint's `last_id` rolled back, as for metrics.jsonl).
- `turns`: one per turn: its request id, token range, reward, observation and response text.
- `requests`: generation requests that failed or were aborted: what had arrived, and the error.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from millstream.shared.store.rows import (
    EpisodeRow,
    RequestRow,
    TurnRow,
    episode_from_failure,
    episode_from_trajectory,
    floats,
    ints,
    pack_floats,
    pack_ints,
)

__all__ = [
    "STORE_FILE",
    "SCHEMA_VERSION",
    "EpisodeRow",
    "TurnRow",
    "RequestRow",
    "open_store",
    "episode_from_trajectory",
    "episode_from_failure",
    "write_episode",
    "last_id",
    "read_episodes",
    "episode_dict",
    "mark_rolled_back_after",
    "ints",
    "floats",
    "pack_ints",
    "pack_floats",
]

STORE_FILE = "store.sqlite"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (
    id INTEGER PRIMARY KEY,
    episode_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    env TEXT NOT NULL,
    seed INTEGER NOT NULL,
    fate TEXT NOT NULL,            -- trained | dropped | failed | fork
    cause TEXT,                    -- why it failed or was dropped; NULL when trained
    message TEXT,
    reward REAL,                   -- NULL when failed: a failure is never scored
    success INTEGER,
    num_turns INTEGER NOT NULL,
    truncated TEXT,
    step INTEGER NOT NULL,         -- the learner's policy version when it was recorded
    trained_version INTEGER,
    min_version INTEGER,
    max_version INTEGER,
    duration_s REAL,
    created REAL NOT NULL,         -- unix time
    rolled_back INTEGER NOT NULL DEFAULT 0,
    fork_of INTEGER,               -- the episodes.id this one branched from (millstream debug)
    fork_turn INTEGER,
    note TEXT,
    tokens BLOB NOT NULL,
    loss_mask BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    versions BLOB NOT NULL,
    advantages BLOB,
    extra TEXT NOT NULL DEFAULT '{}'  -- JSON: segment_starts, anchors, invalid_actions, ...
);
CREATE INDEX IF NOT EXISTS episodes_episode_id ON episodes(episode_id);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes(group_id);
CREATE INDEX IF NOT EXISTS episodes_step ON episodes(step);
CREATE INDEX IF NOT EXISTS episodes_env ON episodes(env);
CREATE INDEX IF NOT EXISTS episodes_reward ON episodes(reward);
CREATE INDEX IF NOT EXISTS episodes_cause ON episodes(cause);
CREATE INDEX IF NOT EXISTS episodes_created ON episodes(created);
CREATE INDEX IF NOT EXISTS episodes_fate ON episodes(fate, id);
CREATE TABLE IF NOT EXISTS turns (
    episode INTEGER NOT NULL REFERENCES episodes(id) ON DELETE CASCADE,
    turn INTEGER NOT NULL,
    request_id TEXT,
    start INTEGER NOT NULL,        -- the reply's token range [start, end) in the episode's tokens
    end INTEGER NOT NULL,
    reward REAL,
    observation TEXT,              -- what the environment said before this turn
    response TEXT,                 -- the decoded reply
    PRIMARY KEY (episode, turn)
);
CREATE INDEX IF NOT EXISTS turns_request ON turns(request_id);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT NOT NULL,
    episode INTEGER NOT NULL REFERENCES episodes(id) ON DELETE CASCADE,
    turn INTEGER NOT NULL,
    status TEXT NOT NULL,          -- failed | aborted
    error TEXT NOT NULL,
    tokens BLOB NOT NULL,          -- what had arrived before it ended
    logprobs BLOB NOT NULL,
    versions BLOB NOT NULL,
    PRIMARY KEY (request_id, episode)
);
"""


# --- the database -----------------------------------------------------------------------------


def open_store(path: Path | str, *, readonly: bool = False, timeout_s: float = 10.0) -> sqlite3.Connection:
    """Open (and, for writing, create) a store. Rows come back as `sqlite3.Row`."""
    path = Path(path)
    if readonly:
        if not path.exists():
            raise FileNotFoundError(f"no trajectory store at {path}")
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s, check_same_thread=False)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=timeout_s, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut may lose the last commit
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        db.commit()
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA foreign_keys=ON")
    return db


def write_episode(db: sqlite3.Connection, row: EpisodeRow) -> int:
    """Insert one episode with its turns and requests (the caller commits); returns its id."""
    generated = [v for v, m in zip(row.versions, row.loss_mask, strict=False) if v >= 0 or m]
    cursor = db.execute(
        "INSERT INTO episodes (episode_id, group_id, env, seed, fate, cause, message, reward, success,"
        " num_turns, truncated, step, trained_version, min_version, max_version, duration_s, created,"
        " fork_of, fork_turn, note, tokens, loss_mask, logprobs, versions, advantages, extra)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            row.episode_id,
            row.group_id,
            row.env,
            row.seed,
            row.fate,
            row.cause,
            row.message,
            row.reward,
            None if row.success is None else int(row.success),
            len(row.turns),
            row.truncated,
            row.step,
            row.trained_version,
            min(generated) if generated else None,
            max(generated) if generated else None,
            row.duration_s,
            row.created or time.time(),
            row.fork_of,
            row.fork_turn,
            row.note,
            pack_ints(row.token_ids),
            bytes(row.loss_mask),
            pack_floats(row.logprobs),
            pack_ints(row.versions),
            None if row.advantages is None else pack_floats(row.advantages),
            orjson.dumps(row.extra).decode(),
        ),
    )
    episode = int(cursor.lastrowid or 0)
    db.executemany(
        "INSERT INTO turns VALUES (?,?,?,?,?,?,?,?)",
        [
            (episode, t.turn, t.request_id, t.start, t.end, t.reward, t.observation, t.response)
            for t in row.turns
        ],
    )
    db.executemany(
        "INSERT OR REPLACE INTO requests VALUES (?,?,?,?,?,?,?,?)",
        [
            (
                r.request_id,
                episode,
                r.turn,
                r.status,
                r.error,
                pack_ints(r.token_ids),
                pack_floats(r.logprobs),
                pack_ints(r.versions),
            )
            for r in row.requests
        ],
    )
    return episode


def episode_dict(db: sqlite3.Connection, row: sqlite3.Row) -> dict[str, Any]:
    """One `episodes` row with its arrays decoded and its turns and failed requests attached,
    in `Trajectory`'s field names where they exist."""
    out = {
        k: row[k]
        for k in row.keys()  # noqa: SIM118 (a Row iterates its values)
        if k not in ("tokens", "loss_mask", "logprobs", "versions", "advantages")
    }
    out["rolled_back"] = bool(out["rolled_back"])
    out["success"] = None if out["success"] is None else bool(out["success"])
    out["token_ids"] = ints(row["tokens"])
    out["loss_mask"] = list(row["loss_mask"])
    out["logprobs"] = floats(row["logprobs"])
    out["versions"] = ints(row["versions"])
    out["advantages"] = None if row["advantages"] is None else floats(row["advantages"])
    out.update(orjson.loads(out.pop("extra")))
    turns = [dict(t) for t in db.execute("SELECT * FROM turns WHERE episode = ? ORDER BY turn", (row["id"],))]
    out["turns"] = turns
    out["turn_starts"] = [t["start"] for t in turns]
    out["turn_ends"] = [t["end"] for t in turns]
    out["turn_rewards"] = [t["reward"] for t in turns]
    out["request_ids"] = [t["request_id"] for t in turns]
    out["requests"] = [
        {
            **dict(r),
            "tokens": ints(r["tokens"]),
            "logprobs": floats(r["logprobs"]),
            "versions": ints(r["versions"]),
        }
        for r in db.execute("SELECT * FROM requests WHERE episode = ?", (row["id"],))
    ]
    return out


def read_episodes(path: Path, where: str = "1", params: tuple = ()) -> list[dict[str, Any]]:
    """Every episode of a store (or those matching `where`), oldest first, as `episode_dict`s."""
    db = open_store(path, readonly=True)
    try:
        rows = db.execute(f"SELECT * FROM episodes WHERE {where} ORDER BY id", params).fetchall()
        return [episode_dict(db, r) for r in rows]
    finally:
        db.close()


def last_id(path: Path) -> int:
    """The newest episode row's id (0 for an empty or missing store): a checkpoint records it."""
    if not path.exists():
        return 0
    db = open_store(path)
    try:
        return int(db.execute("SELECT COALESCE(MAX(id), 0) FROM episodes").fetchone()[0])
    finally:
        db.close()


def mark_rolled_back_after(path: Path, after_id: int) -> int:
    """Mark every episode written after row `after_id` rolled back; returns how many."""
    if not path.exists():
        return 0
    db = open_store(path)
    try:
        cursor = db.execute(
            "UPDATE episodes SET rolled_back = 1 WHERE id > ? AND rolled_back = 0", (after_id,)
        )
        db.commit()
        return cursor.rowcount
    finally:
        db.close()

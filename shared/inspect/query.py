"""Questions to a run's trajectory store: which episodes, and one episode token by token.

    db = open_store(run_dir / STORE_FILE, readonly=True)
    rows = find_episodes(db, Filters(cause="env_timeout", limit=20))
    shown = describe_episode(db, rows[0]["id"], Pieces.for_run(run_dir))

`millstream inspect` (shared/inspect/cli.py) prints these; its web page (shared/inspect/web.py)
serves them as JSON. Both read through a read-only connection, so they work on a live run (the
store is in WAL mode: the learner keeps writing while they read).

Tokens are shown as the model saw them: each id decoded alone with special tokens kept, so
`<|im_start|>` and the template's other markers are visible where they sit in the prompt.
"""

from __future__ import annotations

import functools
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from millstream.shared.store.trajstore import episode_dict

__all__ = [
    "Filters",
    "find_episodes",
    "count_episodes",
    "describe_episode",
    "Pieces",
    "parse_range",
    "FilterError",
]

#: What a listing shows of each episode (no token arrays: a listing stays small).
SUMMARY = (
    "id, episode_id, group_id, env, seed, fate, cause, message, reward, success, num_turns, step,"
    " trained_version, min_version, max_version, duration_s, created, rolled_back, fork_of, fork_turn"
)


class FilterError(ValueError):
    """A filter the store cannot answer, in words (the command line prints it and exits 2)."""


def parse_range(text: str, what: str) -> tuple[int | None, int | None]:
    """`"5"`, `"5:9"`, `":9"`, `"5:"` -> inclusive bounds; anything else is a FilterError."""
    low, sep, high = text.partition(":")
    try:
        lo = int(low) if low else None
        hi = int(high) if high else None
    except ValueError:
        raise FilterError(f"{what} must be N or A:B with whole numbers, got {text!r}") from None
    if not sep:
        hi = lo
    if lo is not None and hi is not None and lo > hi:
        raise FilterError(f"{what} range {text!r} is empty ({lo} > {hi})")
    return lo, hi


@dataclass
class Filters:
    """Every filter is optional; all given ones must hold (AND)."""

    step: tuple[int | None, int | None] = (None, None)
    reward_min: float | None = None
    reward_max: float | None = None
    cause: str | None = None
    fate: str | None = None
    env: str | None = None
    group: str | None = None
    episode: str | None = None
    request: str | None = None
    text: str | None = None
    rolled_back: bool = False  # include episodes a resume rolled back
    limit: int = 50
    newest_first: bool = True

    def where(self) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []

        def add(clause: str, *values: Any) -> None:
            clauses.append(clause)
            params.extend(values)

        if self.step[0] is not None:
            add("step >= ?", self.step[0])
        if self.step[1] is not None:
            add("step <= ?", self.step[1])
        if self.reward_min is not None:
            add("reward >= ?", self.reward_min)
        if self.reward_max is not None:
            add("reward <= ?", self.reward_max)
        for column in ("cause", "fate", "env", "episode_id"):
            value = getattr(self, "episode" if column == "episode_id" else column)
            if value is not None:
                add(f"{column} = ?", value)
        if self.group is not None:
            add("group_id = ?", self.group)
        if self.request is not None:
            add(
                "id IN (SELECT episode FROM turns WHERE request_id = ? "
                "UNION SELECT episode FROM requests WHERE request_id = ?)",
                self.request,
                self.request,
            )
        if self.text is not None:
            like = f"%{self.text}%"
            add(
                "(message LIKE ? OR id IN "
                "(SELECT episode FROM turns WHERE response LIKE ? OR observation LIKE ?))",
                like,
                like,
                like,
            )
        if not self.rolled_back:
            add("rolled_back = 0")
        return (" AND ".join(clauses) or "1"), params


def find_episodes(db: sqlite3.Connection, filters: Filters) -> list[dict[str, Any]]:
    """Episodes matching `filters`, newest first by default; summaries, no tokens."""
    if filters.limit < 1:
        raise FilterError(f"limit must be at least 1, got {filters.limit}")
    where, params = filters.where()
    order = "DESC" if filters.newest_first else "ASC"
    query = f"SELECT {SUMMARY} FROM episodes WHERE {where} ORDER BY id {order} LIMIT ?"
    return [dict(r) for r in db.execute(query, [*params, filters.limit])]


def count_episodes(db: sqlite3.Connection, filters: Filters | None = None) -> dict[str, Any]:
    """How many match, by fate and by cause (the accounting line's shape)."""
    where, params = (filters or Filters()).where()
    by_fate = dict(
        db.execute(f"SELECT fate, COUNT(*) FROM episodes WHERE {where} GROUP BY fate", params).fetchall()
    )
    causes = db.execute(
        f"SELECT fate, cause, COUNT(*) FROM episodes WHERE {where} AND cause IS NOT NULL "
        "GROUP BY fate, cause",
        params,
    ).fetchall()
    return {
        "total": sum(by_fate.values()),
        "fates": by_fate,
        "causes": {f"{fate}/{cause}": n for fate, cause, n in causes},
    }


class Pieces:
    """Each token id as text, decoded alone with special tokens kept (cached per id).

    It reads the model's `tokenizer.json` with `tokenizers` (a core dependency), not
    transformers: a look at one episode should not wait seconds for a library import.
    """

    def __init__(self, tokenizer: Any, special: set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.special = (
            special if special is not None else set(getattr(tokenizer, "all_special_ids", []) or [])
        )
        self.piece = functools.lru_cache(maxsize=65536)(self._piece)

    def _piece(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    @classmethod
    def for_model(cls, model_dir: str | Path) -> Pieces:
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}: cannot show its tokens")
        tokenizer = Tokenizer.from_file(str(path))
        special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        return cls(tokenizer, special)

    @classmethod
    def for_run(cls, run_dir: Path) -> Pieces:
        """The tokenizer of the model the run trained (read from its config.toml)."""
        from millstream.shared.config import load_config
        from millstream.shared.process.runtime import resolve_model_dir

        config = run_dir / "config.toml"
        if not config.is_file():
            raise FileNotFoundError(f"{run_dir} has no config.toml: is it a run directory?")
        return cls.for_model(resolve_model_dir(load_config(config)))

    def text(self, ids: list[int]) -> str:
        return "".join(self.piece(i) for i in ids)


def describe_episode(db: sqlite3.Connection, row_id: int, pieces: Pieces) -> dict[str, Any]:
    """One episode for display: its fields, then per turn the prompt tokens that led to it and
    the reply's tokens, each with its text, logprob, version and advantage; the failed request's
    partial output; and the members of its group, side by side."""
    row = db.execute("SELECT * FROM episodes WHERE id = ?", (row_id,)).fetchone()
    if row is None:
        raise FilterError(f"no episode with row id {row_id}")
    ep = episode_dict(db, row)
    ids, mask, logprobs, versions = ep["token_ids"], ep["loss_mask"], ep["logprobs"], ep["versions"]
    advantages = ep["advantages"] or [None] * len(ids)

    def tokens(start: int, end: int) -> list[dict[str, Any]]:
        return [
            {
                "id": ids[i],
                "text": pieces.piece(ids[i]),
                "special": ids[i] in pieces.special,
                "generated": bool(mask[i]) or versions[i] >= 0,
                "logprob": logprobs[i] if versions[i] >= 0 else None,
                "version": versions[i] if versions[i] >= 0 else None,
                "advantage": advantages[i],
            }
            for i in range(start, end)
        ]

    turns, previous_end = [], 0
    for turn in ep["turns"]:
        turns.append(
            {
                **turn,
                "prompt": tokens(previous_end, turn["start"]),
                "reply": tokens(turn["start"], turn["end"]),
            }
        )
        previous_end = turn["end"]
    tail = tokens(previous_end, len(ids))  # what followed the last reply (a failed turn's prompt)
    requests = [
        {
            **{k: v for k, v in r.items() if k not in ("tokens", "logprobs", "versions")},
            "reply": [
                {
                    "id": t,
                    "text": pieces.piece(t),
                    "special": t in pieces.special,
                    "logprob": lp,
                    "version": v,
                }
                for t, lp, v in zip(r["tokens"], r["logprobs"], r["versions"], strict=False)
            ],
        }
        for r in ep["requests"]
    ]
    group = [
        dict(r)
        for r in db.execute(
            f"SELECT {SUMMARY} FROM episodes WHERE group_id = ? AND fate != 'fork' ORDER BY episode_id",
            (ep["group_id"],),
        )
    ]
    for member in group:
        last = db.execute(
            "SELECT response FROM turns WHERE episode = ? ORDER BY turn DESC LIMIT 1", (member["id"],)
        ).fetchone()
        member["last_reply"] = last[0] if last else ""
    summary = {
        k: v
        for k, v in ep.items()
        if k not in ("token_ids", "loss_mask", "logprobs", "versions", "advantages")
    }
    summary.pop("turns")
    summary.pop("requests")
    return {"episode": summary, "turns": turns, "tail": tail, "requests": requests, "group": group}

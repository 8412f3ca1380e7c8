"""`millstream inspect RUN_DIR`: find episodes in a run's trajectory store, and read one.

    millstream inspect runs/x                        the newest episodes and the counts by fate
    millstream inspect runs/x --cause env_timeout    failed ones with that cause
    millstream inspect runs/x --step 10:20 --reward-max 0 --env sokoban --text "box"
    millstream inspect runs/x --request w0-1734      the episode that made (or lost) that call
    millstream inspect runs/x --episode 42           one episode turn by turn (row id or episode id)
    millstream inspect runs/x --episode 42 --tokens  ... with every token's logprob and version
    millstream inspect runs/x --serve [--port 8377]  the same on a local web page

It reads through a read-only connection, so it works on a live run and on a finished one. A bad
filter, a missing run or store is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from millstream.shared.inspect.query import (
    FilterError,
    Filters,
    Pieces,
    count_episodes,
    describe_episode,
    find_episodes,
    parse_range,
)
from millstream.shared.store.trajstore import STORE_FILE, open_store

__all__ = ["main", "resolve_episode"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="millstream inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run directory (it holds store.sqlite)")
    p.add_argument("--step", help="policy version when recorded: N or A:B (either end may be empty)")
    p.add_argument("--reward-min", type=float)
    p.add_argument("--reward-max", type=float)
    p.add_argument("--cause", help="failure or drop cause, e.g. env_timeout, actor_lost, stale")
    p.add_argument("--fate", choices=["trained", "dropped", "failed", "fork"])
    p.add_argument("--env")
    p.add_argument("--group", help="group id (the members of one GRPO group)")
    p.add_argument("--request", help="a generation request id (a turn's, or a failed call's)")
    p.add_argument("--text", help="substring of a reply, an observation or a failure message")
    p.add_argument("--rolled-back", action="store_true", help="include episodes a resume rolled back")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--episode", help="show one episode: its row id or its episode id")
    p.add_argument("--tokens", action="store_true", help="with --episode: one line per reply token")
    p.add_argument("--serve", action="store_true", help="serve a local web page instead (127.0.0.1)")
    p.add_argument("--host", default="127.0.0.1", help="with --serve: a loopback address")
    p.add_argument("--port", type=int, default=8377, help="with --serve (0: any free port)")
    return p


def _filters(ns: argparse.Namespace) -> Filters:
    return Filters(
        step=parse_range(ns.step, "--step") if ns.step else (None, None),
        reward_min=ns.reward_min,
        reward_max=ns.reward_max,
        cause=ns.cause,
        fate=ns.fate,
        env=ns.env,
        group=ns.group,
        request=ns.request,
        text=ns.text,
        rolled_back=ns.rolled_back,
        limit=ns.limit,
    )


def resolve_episode(db: Any, key: str) -> int:
    """A row id, or the newest row of an episode id (a fork shares its parent's episode id)."""
    if key.isdigit() and db.execute("SELECT 1 FROM episodes WHERE id = ?", (int(key),)).fetchone():
        return int(key)
    row = db.execute(
        "SELECT id FROM episodes WHERE episode_id = ? ORDER BY id DESC LIMIT 1", (key,)
    ).fetchone()
    if row is None:
        raise FilterError(f"no episode {key!r} in the store (neither a row id nor an episode id)")
    return int(row[0])


def main(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    try:
        if not ns.run_dir.is_dir():
            raise FilterError(f"{ns.run_dir} is not a directory")
        filters = _filters(ns)
        if ns.serve:
            from millstream.shared.inspect.web import serve

            return serve(ns.run_dir, ns.host, ns.port)
        db = open_store(ns.run_dir / STORE_FILE, readonly=True)
        if ns.episode is not None:
            shown = describe_episode(db, resolve_episode(db, ns.episode), Pieces.for_run(ns.run_dir))
            print(render_episode(shown, per_token=ns.tokens))
        else:
            print(render_listing(find_episodes(db, filters), count_episodes(db, filters)))
    except (FilterError, FileNotFoundError) as exc:
        print(f"millstream inspect: {exc}", file=sys.stderr)
        return 2
    return 0


# --- rendering --------------------------------------------------------------------------------


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_listing(rows: list[dict[str, Any]], counts: dict[str, Any]) -> str:
    fates = ", ".join(f"{k} {v}" for k, v in sorted(counts["fates"].items())) or "none"
    causes = ", ".join(f"{k} {v}" for k, v in sorted(counts["causes"].items()))
    lines = [f"{counts['total']} episodes match: {fates}" + (f" ({causes})" if causes else "")]
    lines.append(
        f"{'row':>6}  {'step':>5}  {'fate':<8} {'cause':<18} {'reward':>7} {'turns':>5}  {'env':<12} episode"
    )
    for r in rows:
        lines.append(
            f"{r['id']:>6}  {r['step']:>5}  {r['fate']:<8} {r['cause'] or '':<18} {_reward(r['reward']):>7} "
            f"{r['num_turns']:>5}  {r['env']:<12} {r['episode_id']}"
        )
    if len(rows) < counts["total"]:
        lines.append(f"(showing {len(rows)}; --limit N for more)")
    return "\n".join(lines)


def _text(tokens: list[dict[str, Any]]) -> str:
    return "".join(t["text"] for t in tokens)


def _reply_stats(tokens: list[dict[str, Any]]) -> str:
    logprobs = [t["logprob"] for t in tokens if t["logprob"] is not None]
    versions = sorted({t["version"] for t in tokens if t["version"] is not None})
    if not logprobs:
        return "no tokens"
    span = f"v{versions[0]}" + (f"-v{versions[-1]}" if len(versions) > 1 else "")
    mean = sum(logprobs) / len(logprobs)
    return f"{len(tokens)} tokens, logprob mean {mean:.2f} min {min(logprobs):.2f}, {span}"


def _token_lines(tokens: list[dict[str, Any]]) -> list[str]:
    out = []
    for t in tokens:
        adv = "" if t.get("advantage") is None else f"  adv {t['advantage']:+.3f}"
        lp = "" if t["logprob"] is None else f"{t['logprob']:8.3f}"
        out.append(f"      {t['id']:>7} {t['text']!r:<24} {lp}  v{t['version']}{adv}")
    return out


def render_episode(shown: dict[str, Any], per_token: bool = False) -> str:
    ep = shown["episode"]
    head = (
        f"episode {ep['episode_id']} (row {ep['id']})  env {ep['env']}  seed {ep['seed']}"
        f"  group {ep['group_id']}\n"
        f"fate {ep['fate']}"
        + (f" ({ep['cause']})" if ep["cause"] else "")
        + f"  reward {_reward(ep['reward'])}"
        f"  turns {ep['num_turns']}  step {ep['step']}"
        + (f"  trained at v{ep['trained_version']}" if ep["trained_version"] is not None else "")
        + (
            f"\nforked from row {ep['fork_of']} at turn {ep['fork_turn']}: {ep['note']}"
            if ep["fork_of"]
            else ""
        )
        + (f"\nmessage: {ep['message']}" if ep["message"] else "")
    )
    lines = [head]
    for turn in shown["turns"]:
        lines.append(
            f"\n--- turn {turn['turn']}  request {turn['request_id']}  reward {_reward(turn['reward'])}"
        )
        lines.append("  prompt: " + _text(turn["prompt"]).replace("\n", "\n          "))
        lines.append(
            f"  reply ({_reply_stats(turn['reply'])}): " + _text(turn["reply"]).replace("\n", "\n          ")
        )
        if per_token:
            lines += _token_lines(turn["reply"])
    if shown["tail"]:
        lines.append("\n--- after the last reply: " + _text(shown["tail"]).replace("\n", "\n          "))
    for request in shown["requests"]:
        lines.append(
            f"\n!!! request {request['request_id']} (turn {request['turn']}) {request['status']}: "
            f"{request['error']}\n"
            f"    {len(request['reply'])} tokens had arrived: {_text(request['reply'])!r}"
        )
    if len(shown["group"]) > 1:
        lines.append(f"\n--- group {ep['group_id']}: {len(shown['group'])} members")
        for m in shown["group"]:
            mark = "*" if m["id"] == ep["id"] else " "
            lines.append(
                f"  {mark} row {m['id']:>5} {m['fate']:<8} {m['cause'] or '':<16}"
                f" reward {_reward(m['reward']):>7}"
                f"  last reply {m['last_reply'][:60]!r}"
            )
    return "\n".join(lines)

"""`millstream debug`: a GDB-like prompt over one episode (the engine: envpool/debug/engine.py).

    millstream debug RUN_DIR --env evenchars --seed 3          a new episode, the run's actor
    millstream debug RUN_DIR --episode 42                      a recorded one, replayed from its seed
    millstream debug --config run.toml --checkpoint runs/x/checkpoints/step_000040 --env sokoban --seed 1
    printf 'break turn 2\\nrun\\nedit obs hello\\ncont\\nquit\\n' | millstream debug RUN_DIR --episode 42
    millstream debug RUN_DIR --replay --against CKPT_A CKPT_B    where two policies part

Commands (one per line; a script on stdin works the same):

    break turn N | break tool | break cause CAUSE | break reward < X     set a breakpoint
    breaks | delete                        list / clear breakpoints
    run                                    (re)start the episode and run to a breakpoint
    step | cont                            one stop forward / to the next breakpoint or the end
    show                                   the model's input and output, tool calls, env state
    edit obs TEXT | edit tool TEXT         the observation shown now / the tool result shown next
    edit output TEXT | edit tokens 1 2 3   the model's reply (text is tokenized once, as a reply)
    back K                                 back to turn K's input (replays turns 0..K-1)
    quit

When a branch ends it is recorded in the trajectory store (RUN_DIR/store.sqlite, or --store):
an edited branch as a fork (fate "fork", fork_of the episode it branched from, fork_turn the first
edited turn, note the edits); an unedited new episode as fate "debug", the parent of later forks.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from millstream.envpool.actors.client import ActorClient
from millstream.envpool.chat import ChatFormat, tokenizer_dir
from millstream.envpool.debug.actor import actor_for_checkpoint
from millstream.envpool.debug.engine import DebugEpisode
from millstream.envpool.envs import make_env
from millstream.envpool.envs.agents.agent import is_agent_env
from millstream.shared.config import Config, ConfigError, load_config
from millstream.shared.store.trajstore import STORE_FILE, open_store, read_episodes, write_episode
from millstream.shared.wire.keys import load_keys
from millstream.shared.wire.transport import open_channel

__all__ = ["main", "Debugger"]


class Debugger:
    """Reads commands, drives a `DebugEpisode`, prints what happened, records branches."""

    def __init__(
        self, episode: DebugEpisode, store: Path, env_name: str, episode_id: str, parent: int | None
    ):
        self.ep, self.store, self.env_name, self.episode_id = episode, store, env_name, episode_id
        self.parent = parent
        self.breaks: list[tuple[str, Any]] = []
        self.started = False
        self.recorded: list[int] = []

    def say(self, text: str) -> None:
        print(text, flush=True)

    async def command(self, line: str) -> bool:
        """Run one command; False when the session should end."""
        words = line.split(maxsplit=2)
        if not words or words[0].startswith("#"):
            return True
        verb = words[0]
        try:
            if verb in ("quit", "q", "exit"):
                return False
            handler = getattr(self, f"_do_{verb}", None)
            if handler is None:
                known = "break, breaks, delete, run, step, cont, show, edit, back, quit"
                raise ValueError(f"unknown command {verb!r} ({known})")
            await handler(words[1:], line)
        except ValueError as exc:
            self.say(f"error: {exc}")
        except Exception as exc:  # a debugger reports its own bug and keeps the session
            self.say(f"error: {verb} failed: {type(exc).__name__}: {exc}")
        return True

    # --- breakpoints -----------------------------------------------------------------------

    async def _do_break(self, args: list[str], line: str) -> None:
        parts = line.split()[1:]
        if parts[:1] == ["turn"] and len(parts) == 2 and parts[1].isdigit():
            self.breaks.append(("turn", int(parts[1])))
        elif parts == ["tool"]:
            self.breaks.append(("tool", None))
        elif parts[:1] == ["cause"] and len(parts) == 2:
            self.breaks.append(("cause", parts[1]))
        elif parts[:2] == ["reward", "<"] and len(parts) == 3:
            try:
                self.breaks.append(("reward", float(parts[2])))
            except ValueError:
                raise ValueError(f"break reward < X needs a number, got {parts[2]!r}") from None
        else:
            raise ValueError("break turn N | break tool | break cause CAUSE | break reward < X")
        self.say(f"breakpoint {len(self.breaks)}: {' '.join(parts)}")

    async def _do_breaks(self, args: list[str], line: str) -> None:
        self.say(
            "\n".join(f"{i + 1}: {k} {'' if v is None else v}" for i, (k, v) in enumerate(self.breaks))
            or "none"
        )

    async def _do_delete(self, args: list[str], line: str) -> None:
        self.breaks.clear()
        self.say("breakpoints cleared")

    def _hit(self) -> str | None:
        ep = self.ep
        for kind, value in self.breaks:
            if kind == "turn" and ep.stop == "input" and len(ep.turns) - 1 == value:
                return f"break turn {value}"
            if kind == "tool" and ep.stop == "output" and ep.tool_calls():
                return "break tool"
            if kind == "cause" and ep.stop == "failed" and ep.failure and str(ep.failure[0]) == value:
                return f"break cause {value}"
            if kind == "reward" and ep.stop == "result" and (ep.turn.reward or 0.0) < value:
                return f"break reward < {value}"
        return None

    # --- moving ----------------------------------------------------------------------------

    async def _do_run(self, args: list[str], line: str) -> None:
        self.ep.turns, self.ep.edits, self.ep.failure, self.ep.stop = [], [], None, "input"
        await self.ep.start()
        self.started = True
        if not self._where(self._hit()):
            await self._do_cont(args, line)

    async def _do_step(self, args: list[str], line: str) -> None:
        self._need_started()
        await self.ep.advance()
        self._where(self._hit() or "step")

    async def _do_cont(self, args: list[str], line: str) -> None:
        self._need_started()
        while self.ep.stop not in ("done", "failed"):
            await self.ep.advance()
            hit = self._hit()
            if hit:
                self._where(hit)
                return
        self._where(None)

    async def _do_back(self, args: list[str], line: str) -> None:
        if not self.started:
            raise ValueError("the episode has not started: `run` first")
        if not args or not args[0].isdigit():
            raise ValueError("back K: the turn to go back to")
        await self.ep.back(int(args[0]))
        self._where(f"back to turn {args[0]}")

    def _need_started(self) -> None:
        if not self.started:
            raise ValueError("the episode has not started: `run` first")
        if self.ep.stop in ("done", "failed"):
            raise ValueError("the branch has ended: `back K` to take another, or `run` to start over")

    def _where(self, why: str | None) -> bool:
        """Say where the branch stands; record it if it ended. True if it stopped on `why`."""
        ep = self.ep
        if ep.stop in ("done", "failed"):
            if ep.stop == "failed" and ep.failure:
                self.say(f"failed at turn {len(ep.turns) - 1}: {ep.failure[0]}: {ep.failure[1]}")
            else:
                reward = sum(t.reward or 0.0 for t in ep.turns)
                self.say(f"episode done after {len(ep.turns)} turns, reward {reward:.3f}")
            self._record()
            return why is not None
        if why:
            self.say(f"stopped at turn {len(ep.turns) - 1} {ep.stop} ({why})")
        return why is not None

    # --- looking and editing ---------------------------------------------------------------

    async def _do_show(self, args: list[str], line: str) -> None:
        ep = self.ep
        if not ep.turns:
            raise ValueError("nothing to show yet: `run` first")
        t = ep.turn
        pieces = ep.chat.tokenizer.decode(ep.model_input(), skip_special_tokens=False)
        self.say(f"--- turn {len(ep.turns) - 1}, at {ep.stop}")
        self.say(f"model input ({len(ep.model_input())} tokens):\n{pieces}")
        if ep.stop != "input":
            source = "replayed" if t.replayed else f"request {t.request_id}"
            self.say(f"model output ({len(t.reply_ids)} tokens, {source}):\n{t.reply}")
            for call in ep.tool_calls():
                self.say(f"tool call: {call}")
        if t.reward is not None:
            self.say(f"env result: reward {t.reward:.3f} done {t.done} info {t.info}")
            self.say(f"next observation (tool result):\n{t.next_observation}")
        self.say(f"env state: {ep.env_state()}")

    async def _do_edit(self, args: list[str], line: str) -> None:
        if len(args) < 2:
            raise ValueError("edit obs TEXT | edit tool TEXT | edit output TEXT | edit tokens 1 2 3")
        what, value = args[0], line.split(maxsplit=2)[2]
        if what in ("obs", "tool"):
            if (what == "obs") != (self.ep.stop == "input"):
                raise ValueError(f"`edit {what}` is for the {'input' if what == 'obs' else 'result'} stop")
            self.ep.edit_observation(value)
        elif what == "output":
            self.ep.edit_output_text(value)
        elif what == "tokens":
            try:
                self.ep.edit_output([int(x) for x in value.split()])
            except ValueError as exc:
                raise ValueError(f"edit tokens needs token ids: {exc}") from None
        else:
            raise ValueError(f"cannot edit {what!r}: obs, tool, output or tokens")
        self.say(f"edited {what} at turn {len(self.ep.turns) - 1}")

    # --- the record ------------------------------------------------------------------------

    def _record(self) -> None:
        fate = "fork" if self.ep.edits else "debug"
        if fate == "debug" and self.parent is not None:
            self.say("no edits: nothing recorded (the same as the recorded episode)")
            return
        row = self.ep.to_row(
            episode_id=self.episode_id, env_name=self.env_name, fate=fate, fork_of=self.parent
        )
        db = open_store(self.store)
        try:
            with db:
                row_id = write_episode(db, row)
        finally:
            db.close()
        self.recorded.append(row_id)
        if fate == "debug":
            self.parent = row_id  # later edited branches fork from it
            self.say(f"recorded as row {row_id} in {self.store}")
        else:
            self.say(f"recorded as row {row_id}: a fork of row {self.parent} at turn {row.fork_turn}")


# --- the command line -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="millstream debug", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", nargs="?", type=Path, help="a run directory (its config, actor and store)")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    p.add_argument("--config", type=Path, help="a config file, without a run directory")
    p.add_argument("--actor", help="a running actor's address (default: the run's actor.address)")
    p.add_argument("--checkpoint", type=Path, help="start an actor on this checkpoint (or model dir)")
    p.add_argument("--env", help="a new episode of this environment (default: the run's)")
    p.add_argument("--seed", type=int, default=0, help="with --env: the episode's seed")
    p.add_argument("--episode", help="replay this recorded episode (its store row id) from its seed")
    p.add_argument("--store", type=Path, help="where branches are recorded (default RUN_DIR/store.sqlite)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a whole session may take")
    p.add_argument("--replay", action="store_true", help="replay recorded episodes against --against A B")
    p.add_argument(
        "--against", nargs=2, metavar=("A", "B"), help="two checkpoints, model dirs or tcp:// actors"
    )
    p.add_argument("--episodes", type=int, default=10, help="with --replay: how many recent episodes")
    p.add_argument("--temperature", type=float, default=0.0, help="with --replay: sampling (0: greedy)")
    return p


def _config(ns: argparse.Namespace) -> Config:
    if ns.run_dir is not None and "=" in str(ns.run_dir):  # no run directory: an override
        ns.overrides.insert(0, str(ns.run_dir))
        ns.run_dir = None
    source = ns.run_dir / "config.toml" if ns.run_dir else ns.config
    if source is not None and not Path(source).is_file():
        raise ConfigError(f"no config at {source}")
    return load_config(source, ns.overrides)


def _recorded(store: Path, key: str) -> tuple[dict[str, Any], list[list[int]]]:
    """A recorded episode (`episode_dict`) and its replies (token ids per turn), from the store."""
    found = read_episodes(store, "id = ?", (int(key),)) if key.isdigit() else []
    if not found:
        raise ConfigError(f"no episode with row id {key!r} in {store}")
    ep = found[0]
    return ep, [ep["token_ids"][s:e] for s, e in zip(ep["turn_starts"], ep["turn_ends"], strict=True)]


async def _session(ns: argparse.Namespace, cfg: Config, lines: Any) -> int:
    store = ns.store or (ns.run_dir / STORE_FILE if ns.run_dir else Path(cfg.run.dir or ".") / STORE_FILE)
    env_name, env_args, seed, script, parent = (
        ns.env or cfg.envpool.env,
        cfg.envpool.env_args,
        ns.seed,
        None,
        None,
    )
    if ns.episode is not None:
        row, script = _recorded(store, ns.episode)
        env_name, seed, parent = row["env"], row["seed"], row["id"]
        if env_name != cfg.envpool.env:
            env_args = {}
    if is_agent_env(make_env(env_name, env_args)):  # an unknown env or bad args fail here too
        raise ConfigError(f"{env_name} is an agent environment: its agent runs whole, not turn by turn")
    chat = ChatFormat.from_model_dir(tokenizer_dir(cfg))
    keys = load_keys(cfg, "envpool")
    async with AsyncExitStack() as stack:
        address = ns.actor or cfg.actor.address
        if ns.checkpoint is not None:
            address = stack.enter_context(actor_for_checkpoint(ns.checkpoint, cfg))
        channel = open_channel("dealer", address, bind=False, cfg=cfg.transport, keys=keys)
        client = ActorClient(channel, "debug")
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.run)
            episode = DebugEpisode(
                lambda: make_env(env_name, env_args), seed, chat, client, cfg.envpool, script
            )
            episode_id = f"debug-{env_name}-{seed}" if parent is None else str(row["episode_id"])
            debugger = Debugger(episode, store, env_name, episode_id, parent)
            say = (
                f"replaying row {parent}" if parent is not None else f"new episode of {env_name}, seed {seed}"
            )
            print(f"millstream debug: {say}, actor {address}; `run` starts it", flush=True)
            with anyio.fail_after(ns.timeout):
                while True:
                    line = await anyio.to_thread.run_sync(lines.readline)
                    if not line:
                        break
                    print(f"(debug) {line.strip()}", flush=True)
                    if not await debugger.command(line.strip()):
                        break
            tg.cancel_scope.cancel()
    return 0


def _replay(ns: argparse.Namespace, cfg: Config) -> int:
    from millstream.envpool.debug.replay import replay_against

    if not ns.against:
        raise ConfigError("--replay needs --against A B (checkpoints, model dirs or tcp:// actors)")
    store = ns.store or (ns.run_dir / STORE_FILE if ns.run_dir else Path(cfg.run.dir or ".") / STORE_FILE)
    chat = ChatFormat.from_model_dir(tokenizer_dir(cfg))
    replay_against(cfg, chat, store, ns.against, ns.episode, ns.episodes, ns.temperature)
    return 0


def main(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    try:
        cfg = _config(ns)
        if ns.replay:
            return _replay(ns, cfg)
        return anyio.run(_session, ns, cfg, sys.stdin, backend="trio")
    except (ConfigError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"millstream debug: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

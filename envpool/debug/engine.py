"""One episode, turn by turn, under the user's hand: the engine of `millstream debug`.

A turn goes through three stops, in order:

    input   the model's input is ready (the observation rendered by the chat template);
            `edit obs TEXT` changes what the model will be shown
    output  the model replied (or a recorded reply was replayed); `edit output TEXT` or
            `edit tokens 1 2 3` replaces the reply before the environment sees it
    result  the environment answered (reward, done, the next observation: a tool's result);
            `edit tool TEXT` changes the observation the model sees next

`step` moves one stop, `cont` runs to the next breakpoint (envpool/debug/repl.py), `back K`
returns to turn K's input: the environment is reset with the episode's seed and the replies of
turns 0..K-1 are played into it again (environments are functions of seed and actions).

Replayed, then generated: a recorded episode (from the trajectory store) is replayed from its
seed with its recorded replies, token for token, until the first edit; from there the running
actor generates, and the branch is a *fork*. Token in, token out: a text edit of the reply is
tokenized once as a new reply; the model's own tokens are never re-tokenized.

A failure (the environment raised or hung, the actor failed) ends the branch with its cause, as
in a run (envpool/episode.py); it is never scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from millstream.envpool.actors.client import TurnClient
from millstream.envpool.actors.generation import Generation, GenerationFailed, Retry, Sampling
from millstream.envpool.agents.toolcalls import parse_tool_calls
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import Env
from millstream.envpool.episode import EnvFailure, call_env
from millstream.envpool.record import EpisodeRecord, EpisodeSpec
from millstream.envpool.seeds import sampling_seed
from millstream.shared.config import EnvPoolConfig
from millstream.shared.store.rows import EpisodeRow, TurnRow
from millstream.shared.wire import Cause

__all__ = ["Turn", "DebugEpisode", "Stop"]

Stop = str  # "input" | "output" | "result" | "done" | "failed"


@dataclass
class Turn:
    """One turn of the branch being debugged."""

    observation: str  # what the model was shown for this turn (after any edit)
    prompt_ids: list[int]  # tokens the turn added before the reply (first prompt, or the bridge)
    reply_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reply: str = ""
    request_id: str = ""
    replayed: bool = False  # the recorded reply, not generated now
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    next_observation: str = ""


class DebugEpisode:
    """The branch being debugged: its turns, where it stands (`stop`), and the edits made."""

    def __init__(
        self,
        make_env: Any,
        seed: int,
        chat: ChatFormat,
        client: TurnClient,
        cfg: EnvPoolConfig,
        script: list[list[int]] | None = None,
    ) -> None:
        self.make_env, self.seed, self.chat, self.client, self.cfg = make_env, seed, chat, client, cfg
        self.sampling = Sampling.for_turns(cfg, chat.stop_token_ids)
        self.retry = Retry.from_config(cfg)
        #: Recorded replies (token ids) by turn: replayed until the first edit.
        self.script = list(script or [])
        self.env: Env = make_env()
        self.system = getattr(self.env, "system_prompt", "")
        self.turns: list[Turn] = []
        self.stop: Stop = "input"
        self.edits: list[dict[str, Any]] = []
        self.failure: tuple[Cause, str] | None = None

    # --- where it stands -------------------------------------------------------------------

    @property
    def turn(self) -> Turn:
        return self.turns[-1]

    @property
    def diverged(self) -> bool:
        return bool(self.edits)

    def model_input(self) -> list[int]:
        """The token ids the model sees (or saw) for the current turn's reply."""
        return self.record(with_current_reply=False).ids

    def record(self, spec: EpisodeSpec | None = None, *, with_current_reply: bool = True) -> EpisodeRecord:
        """The branch as an episode record (envpool/record.py), as a run would have recorded it."""
        record = EpisodeRecord(spec or EpisodeSpec("debug", "debug", self.seed, 0, 1, ""))
        for t in self.turns:
            record.add_prompt(t.prompt_ids)
            if t is not self.turn or with_current_reply:
                reply = Generation(t.reply_ids, t.logprobs, t.versions, request_id=t.request_id)
                record.add_reply(reply)
        return record

    def tool_calls(self) -> list[Any]:
        return parse_tool_calls(self.turn.reply).tool_calls if self.turns and self.turn.reply else []

    def env_state(self) -> str:
        """What the environment shows of itself: `render()` if it has one, else its fields."""
        render = getattr(self.env, "render", None)
        if callable(render):
            try:
                return str(render())
            except Exception as exc:  # a debugger shows a broken render, it does not die of it
                return f"(render raised {type(exc).__name__}: {exc})"
        fields = {k: v for k, v in vars(self.env).items() if not k.startswith("_")}
        return ", ".join(f"{k}={v!r:.80}" for k, v in fields.items()) or "(no state shown)"

    # --- moving ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Reset the environment with the seed: turn 0's input stop."""
        self.env = self.make_env()
        obs = await self._env("reset", self.env.reset, self.seed)
        if obs is not None:
            self._open_turn(obs.text, first=True)

    async def advance(self) -> Stop:
        """Move one stop forward; returns the new stop."""
        if self.stop == "input":
            await self._reply()
        elif self.stop == "output":
            await self._step_env()
        elif self.stop == "result":
            self._next_turn()
        return self.stop

    async def back(self, turn: int) -> None:
        """Return to `turn`'s input stop: reset, then play the earlier replies into the env."""
        if not 0 <= turn < len(self.turns):
            raise ValueError(f"no turn {turn} to go back to (turns 0..{len(self.turns) - 1})")
        kept = self.turns[:turn]
        self.script = [t.reply_ids for t in self.turns]  # the branch so far is the new script
        self.turns, self.failure, self.stop = [], None, "input"
        await self.start()
        for old in kept:
            self.turn.observation = old.observation
            self.turn.prompt_ids = self._prompt_for(old.observation)
            self._take_reply(Generation(old.reply_ids, old.logprobs, old.versions, request_id=old.request_id))
            self.turn.replayed = old.replayed
            await self._step_env()
            self._next_turn()
        self.edits = [e for e in self.edits if e["turn"] < turn]

    # --- edits -----------------------------------------------------------------------------

    def edit_observation(self, text: str) -> None:
        """At input: what the model is shown this turn. At result: the next observation."""
        if self.stop == "input":
            self.turn.observation = text
            self.turn.prompt_ids = self._prompt_for(text)
            self._edited("obs", text)
        elif self.stop == "result":
            self.turn.next_observation = text
            self._edited("tool", text)
        else:
            raise ValueError(f"the observation is edited at an input or result stop, not at {self.stop}")

    def edit_output(self, ids: list[int], text: str | None = None) -> None:
        if self.stop != "output":
            raise ValueError(f"the model's output is edited at an output stop, not at {self.stop}")
        self._take_reply(Generation(ids, [0.0] * len(ids), [-1] * len(ids)))
        self._edited("output", text if text is not None else ids)

    def edit_output_text(self, text: str) -> None:
        self.edit_output(self.chat.encode(text) + [self.chat.eos_id], text)

    def _edited(self, what: str, value: Any) -> None:
        self.edits.append({"turn": len(self.turns) - 1, "what": what, "value": value})

    # --- the steps -------------------------------------------------------------------------

    def _prompt_for(self, observation: str) -> list[int]:
        if len(self.turns) <= 1:
            return self.chat.first_prompt(self.system, observation)
        previous = self.turns[-2]
        return self.chat.close_turn(previous.reply_ids) + self.chat.next_prompt(observation)

    def _open_turn(self, observation: str, first: bool = False) -> None:
        self.turns.append(Turn(observation, []))
        self.turn.prompt_ids = self._prompt_for(observation)
        self.stop = "input"

    async def _reply(self) -> None:
        index = len(self.turns) - 1
        if not self.diverged and index < len(self.script):
            self._take_reply(Generation(self.script[index], [0.0] * len(self.script[index]), []))
            self.turn.replayed = True
            return
        try:
            gen = await self.client.generate(
                self.model_input(), self.sampling, seed=sampling_seed(self.seed, 0, index), retry=self.retry
            )
        except GenerationFailed as exc:
            self._fail(exc.cause, str(exc))
            return
        self._take_reply(gen)

    def _take_reply(self, gen: Generation) -> None:
        t = self.turn
        t.reply_ids, t.logprobs = list(gen.token_ids), list(gen.logprobs)
        t.versions = list(gen.versions) or [-1] * len(gen.token_ids)
        t.reply, t.request_id = self.chat.decode(gen.token_ids), gen.request_id
        self.stop = "output"

    async def _step_env(self) -> None:
        result = await self._env("step", self.env.step, self.turn.reply)
        if result is None:
            return
        t = self.turn
        t.reward, t.done, t.info = float(result.reward), bool(result.done), dict(result.info)
        t.next_observation = result.observation.text
        self.stop = "result"

    def _next_turn(self) -> None:
        if self.turn.done or len(self.turns) >= self.cfg.max_turns:
            self.stop = "done"
            return
        self._open_turn(self.turn.next_observation)

    async def _env(self, what: str, fn: Any, arg: Any) -> Any:
        """The env call as a run makes it (envpool/episode.py); a failure ends the branch."""
        try:
            return await call_env(what, fn, arg, self.cfg.step_timeout_s)
        except EnvFailure as exc:
            self._fail(exc.cause, str(exc))
            return None

    def _fail(self, cause: Cause, message: str) -> None:
        self.failure = (cause, message)
        self.stop = "failed"

    # --- the record ------------------------------------------------------------------------

    def to_row(self, *, episode_id: str, env_name: str, fate: str, fork_of: int | None) -> EpisodeRow:
        """The branch as a trajectory store row (shared/store/rows.py): a fork when edited."""
        record = self.record(EpisodeSpec(episode_id, "debug", self.seed, 0, 1, env_name))
        turns = [
            TurnRow(i, t.request_id or None, start, end, t.reward, t.observation, t.reply)
            for i, (t, start, end) in enumerate(zip(self.turns, record.turn_starts, record.turn_ends))
        ]
        rewards = [t.reward for t in self.turns if t.reward is not None]
        first_edit = min((e["turn"] for e in self.edits), default=None)
        mask, logprobs, versions = record.token_lists()
        return EpisodeRow(
            episode_id=episode_id,
            group_id="debug",
            env=env_name,
            seed=self.seed,
            fate=fate,
            step=-1,
            token_ids=record.ids,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            turns=turns,
            cause=None if self.failure is None else str(self.failure[0]),
            message=None if self.failure is None else self.failure[1],
            reward=None if self.failure is not None else sum(rewards),
            fork_of=fork_of,
            fork_turn=first_edit,
            note=orjson.dumps(self.edits).decode() if self.edits else None,
            extra={"replayed_turns": [i for i, t in enumerate(self.turns) if t.replayed]},
        )

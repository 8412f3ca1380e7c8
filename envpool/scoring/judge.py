"""An LLM judge as the reward: a frozen model grades every finished episode.

    [judge]
    model_path = "/models/judge"        # served by one more actor, `judge`, never updated
    rubric = "Task:\\n{task}\\n\\nAnswer:\\n{response}\\n\\nGrade the answer."
    score_pattern = '(?i)score\\s*[:=]?\\s*(-?\\d+(?:\\.\\d+)?)'
    max_score = 10
    mode = "replace"                     # or "add": env reward + weight * judged score

The judge is an ordinary actor (actor/main.py with `--judge`): the same vLLM engine, the same
wire protocol, the same `ActorClient` the episodes use, so it batches the judgements of every
worker like any generation. It refuses weight updates (it is frozen: grading with the policy's own
moving weights would let the policy learn to please itself), and the learner never learns its
address.

Each worker holds one DEALER connection to it. A finished `Trajectory` is rendered into the
judge's own chat template (its tokenizer may differ from the policy's): the system prompt and the
rubric, filled with the episode's first observation (`{task}`), the policy's last reply
(`{response}`) and the whole conversation (`{transcript}`). The judge's reply is searched with
`score_pattern`; the first group is the score, scaled by `max_score` into [0, 1].

A judgement that does not come (the judge's generation failed after `judge.retries`, or timed
out) ends the episode as `judge_failed`; a reply without a score as `judge_unparsable`. Both are
counted causes, never a reward of 0: a judge that cannot answer says nothing about the policy.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import anyio
import msgspec

from millstream.envpool.actors.client import ActorClient
from millstream.envpool.actors.generation import GenerationFailed, Retry, Sampling
from millstream.envpool.chat import ChatFormat, ChatTemplateError
from millstream.shared.config import Config
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory
from millstream.shared.wire.keys import RunKeys
from millstream.shared.wire.transport import open_channel

__all__ = ["Judge", "JudgeFailed", "render_rubric", "read_score", "judge_messages"]

log = logging.getLogger(__name__)


class JudgeFailed(Exception):
    """No judgement for an episode; `cause` is its failure cause."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def render_rubric(rubric: str, traj: Trajectory) -> str:
    """The judge's user message for `traj` (`texts` alternates observation, reply, ...)."""
    texts = traj.texts
    replies = texts[1::2]
    transcript = "\n\n".join(
        f"{'Assistant' if i % 2 else 'User'}: {text}" for i, text in enumerate(texts) if text
    )
    return rubric.format(
        task=texts[0] if texts else "", response=replies[-1] if replies else "", transcript=transcript
    )


def judge_messages(system_prompt: str, rubric: str) -> list[dict[str, str]]:
    """The judge's conversation: its system prompt (if any) and the filled rubric."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": rubric}]


def read_score(pattern: re.Pattern[str], reply: str, max_score: float) -> float:
    """The judged score in [0, 1]; raises JudgeFailed(judge_unparsable) when there is none."""
    match = pattern.search(reply)
    try:
        score = float(match.group(1)) if match else float("nan")
    except (TypeError, ValueError):  # an optional group that did not take part, or no number
        score = float("nan")
    if score != score:  # NaN: no score (a NaN the judge wrote would be none either)
        raise JudgeFailed(Cause.JUDGE_UNPARSABLE, f"no score in the judge's reply {reply[:200]!r}")
    return min(max(score / max_score, 0.0), 1.0)


class Judge:
    """One worker's connection to the judge actor; run `run()` in the worker's task group."""

    def __init__(self, cfg: Config, worker: str, keys: RunKeys | None) -> None:
        self.cfg = cfg.judge
        self.chat = ChatFormat.from_model_dir(cfg.judge.model_path)
        judge = cfg.judge
        self.sampling = Sampling(
            max_tokens=judge.max_tokens,
            temperature=judge.temperature,
            stop_token_ids=tuple(self.chat.stop_token_ids),
            timeout_s=judge.timeout_s,
        )
        self.retry = Retry(judge.retries, backoff_s=1.0)
        self.pattern = re.compile(cfg.judge.score_pattern)
        self.channel = open_channel(
            "dealer",
            cfg.judge.connect or cfg.judge.address,
            bind=False,
            cfg=cfg.transport,
            keys=keys,
            recv_queue=4096,
            monitor_events=ActorClient.MONITOR_EVENTS,
        )
        self.client = ActorClient(self.channel, f"{worker}-judge")
        self.judged = 0
        self.failed: dict[str, int] = {}
        self.score_sum = 0.0

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.channel.run)
            tg.start_soon(self.client.run)
            tg.start_soon(self.client.watch_connection)

    async def score(self, traj: Trajectory, seed: int) -> Trajectory | EpisodeFailed:
        """`traj` with its reward from the judge, or the episode failed with a judge cause."""
        try:
            judged = await self._judge(traj, seed)
        except JudgeFailed as exc:
            self.failed[exc.cause.value] = self.failed.get(exc.cause.value, 0) + 1
            return EpisodeFailed(traj.episode_id, traj.group_id, traj.group_size, exc.cause, str(exc)[:500])
        self.judged += 1
        self.score_sum += judged
        return _rescored(traj, judged, self.cfg.mode, self.cfg.weight)

    async def _judge(self, traj: Trajectory, seed: int) -> float:
        cfg = self.cfg
        try:
            # `apply`, not `first_prompt`: every rubric is unique, a cache would only hold memory.
            prompt = self.chat.apply(judge_messages(cfg.system_prompt, render_rubric(cfg.rubric, traj)))
        except ChatTemplateError as exc:
            raise JudgeFailed(Cause.JUDGE_FAILED, f"the judge's chat template: {exc}") from None
        try:
            gen = await self.client.generate(prompt, self.sampling, seed=seed, retry=self.retry)
        except GenerationFailed as exc:
            raise JudgeFailed(Cause.JUDGE_FAILED, f"the judge did not answer: {exc}") from None
        return read_score(self.pattern, self.chat.decode(gen.token_ids), cfg.max_score)

    def statistics(self) -> dict[str, Any]:
        return {
            "judged": self.judged,
            "failed": dict(self.failed),
            "score_mean": self.score_sum / self.judged if self.judged else None,
            "client": self.client.statistics(),
        }


def _rescored(traj: Trajectory, judged: float, mode: str, weight: float) -> Trajectory:
    """The judged score on the last turn: instead of the env's rewards, or added to them."""
    turns = list(traj.turn_rewards) or [0.0]
    if mode == "replace":
        turns = [0.0] * (len(turns) - 1) + [judged]
    else:
        turns[-1] += weight * judged
    return msgspec.structs.replace(traj, turn_rewards=turns, reward=sum(turns))

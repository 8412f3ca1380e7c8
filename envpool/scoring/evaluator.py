"""Evaluation during training: rounds of episodes that are scored, reported, and never trained on.

Who runs it: envpool worker 0, the process that already holds the chat format, the environment
registry and a client of the actor replicas. When it sees the learner announce policy version
`v` with `v % eval.every == 0` (version 0 included: the untrained baseline), it starts a round
in the background: `eval.episodes` problems (seeds `eval.seed + i`; the dataset env plays row
`i`), `eval.samples` episodes each, at `eval.temperature` (0: greedy), in `eval.env` with
`eval.env_args` (merged over the training env's arguments when the env is the same one, so
`eval.env_args = {split = "eval"}` is all a dataset run needs). It then pushes one `EvalResult`
(shared/wire/protocol.py) to the learner, which writes it as `eval/...` metrics and puts the final
version's round into summary.json.

Why a worker and not the learner: the learner never tokenizes or plays environments, and a
worker sends its requests to the actor like any episode, so evaluation costs no extra engine.
Evaluation episodes are not announced (`GroupStarted`), not counted in the worker's statistics
and never pushed as trajectories, so the learner's accounting and replay buffer never see
them; the round's own counts travel in `EvalResult`.

Bounds: at most `eval.max_concurrent` evaluation episodes run at once; one round runs at a
time, and a version that becomes due while one runs replaces any older one still waiting
(`skipped`); a round stops after `eval.timeout_s`, its unfinished episodes counted as failed
(`episode_timeout`). When the learner is final, `finish` abandons a round of an older version
and plays the final version's, bounded by the same timeout, before the worker says `PoolDone`.

The policy may change during a round (training goes on): `EvalResult.token_versions` says
which versions sampled its tokens. Failed episodes are counted by cause and left out of every
mean, never scored 0. pass@k is the share of problems (with at least one finished episode) of
which some episode succeeded, with k = `eval.samples`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from millstream.envpool.actors.router import Router
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import Observation, StepResult, make_env
from millstream.envpool.episode import EpisodeSpec, run_episode
from millstream.shared.config import Config
from millstream.shared.wire import Cause, EpisodeFailed, EvalResult, Trajectory

__all__ = ["Evaluator", "eval_env", "summarize"]

log = logging.getLogger("envpool")


def eval_env(cfg: Config) -> tuple[str, dict[str, Any]]:
    """The evaluation environment's name and arguments."""
    ev, pool = cfg.eval, cfg.envpool
    if ev.env and ev.env != pool.env:
        return ev.env, dict(ev.env_args)
    return pool.env, {**pool.env_args, **ev.env_args}


class _Recording:
    """An environment that remembers whether its last step succeeded (`info["success"]`)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.system_prompt = getattr(env, "system_prompt", "")
        self.success = False

    async def reset(self, seed: int) -> Observation:
        self.success = False
        obs: Observation = await self.env.reset(seed)
        return obs

    async def step(self, action: str) -> StepResult:
        result: StepResult = await self.env.step(action)
        self.success = bool(result.info.get("success", False))
        return result


def summarize(
    outcomes: dict[tuple[int, int], tuple[Trajectory | EpisodeFailed, bool]], problems: int, samples: int
) -> dict[str, Any]:
    """EvalResult's numbers from each (problem, sample)'s outcome and success; missing
    outcomes (a round that timed out) count as failed `episode_timeout`.

    Failed episodes are left out, problem by problem: `success` (pass@1) is the mean over
    problems of each one's share of finished episodes that succeeded, so a problem whose samples
    failed weighs as much as any other; `pass_at_k` (k = `samples`) is over the problems whose
    k episodes all finished (`pass_at_k_problems`): with n = k samples, Chen et al.'s unbiased
    estimator 1 - C(n-c, k) / C(n, k) is whether one succeeded, and a problem with fewer
    finished samples would be measured at a smaller k."""
    failed: Counter[str] = Counter()
    rewards: list[float] = []
    per_problem: dict[int, list[bool]] = {}
    versions: list[int] = []
    for i in range(problems):
        for j in range(samples):
            outcome = outcomes.get((i, j))
            if outcome is None:
                failed[str(Cause.EPISODE_TIMEOUT)] += 1
                continue
            result, success = outcome
            if isinstance(result, EpisodeFailed):
                failed[str(result.cause)] += 1
                continue
            rewards.append(result.reward)
            per_problem.setdefault(i, []).append(success)
            versions += [v for v, m in zip(result.versions, result.loss_mask) if m]
    whole = [any(s) for s in per_problem.values() if len(s) == samples]
    return {
        "finished": len(rewards),
        "failed": dict(failed),
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "success": sum(sum(s) / len(s) for s in per_problem.values()) / len(per_problem)
        if per_problem
        else 0.0,
        "pass_at_k": sum(whole) / len(whole) if whole else 0.0,
        "pass_at_k_problems": len(whole),
        "token_versions": [min(versions), max(versions)] if versions else [],
    }


class Evaluator:
    """Plays evaluation rounds for due versions and sends each round's `EvalResult`."""

    def __init__(
        self,
        cfg: Config,
        worker: str,
        chat: ChatFormat,
        client: Router,
        send: Callable[[EvalResult], Awaitable[None]],
        max_model_len: Callable[[], int],
    ) -> None:
        self.cfg, self.ev, self.worker = cfg, cfg.eval, worker
        self.chat, self.client, self.send, self.max_model_len = chat, client, send, max_model_len
        self.env_name, self.env_args = eval_env(cfg)
        make_env(self.env_name, self.env_args)  # fail fast, as the worker does for its own env
        self.pool = msgspec.structs.replace(cfg.envpool, temperature=self.ev.temperature)
        self.limiter = anyio.CapacityLimiter(self.ev.max_concurrent)
        self.pending: int | None = None
        self.running: int | None = None
        self.evaluated: set[int] = set()
        self.rounds = self.skipped = 0
        self._scope: anyio.CancelScope | None = None
        self._changed = anyio.Event()

    def due(self, version: int) -> bool:
        return self.ev.every > 0 and version % self.ev.every == 0

    def notice(self, version: int, *, force: bool = False) -> None:
        """The learner announced `version`: queue a round for it if it is due and new."""
        if not (force or self.due(version)) or version in self.evaluated or version == self.running:
            return
        if self.pending is not None and self.pending != version:
            self.skipped += 1  # one round at a time: the newest waiting version wins
        self.pending = max(version, self.pending if self.pending is not None else version)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def run(self) -> None:
        """Background loop (runs until cancelled): one round per pending version."""
        while True:
            while self.pending is None:
                await self._changed.wait()
            version, self.pending = self.pending, None
            self.running = version
            with anyio.CancelScope() as self._scope:
                result = await self.play_round(version)
                self.evaluated.add(version)
                with anyio.CancelScope(shield=True):
                    await self.send(result)
            self.running, self._scope = None, None
            self._wake()

    async def finish(self, final_version: int) -> None:
        """The learner is final: make sure `final_version` is evaluated and reported (bounded);
        a round of an older version still running is abandoned."""
        if self.ev.every == 0:
            return
        if self.running is not None and self.running != final_version and self._scope is not None:
            self._scope.cancel()
            self.skipped += 1
        self.pending = None
        self.notice(final_version, force=True)
        with anyio.move_on_after(self.ev.timeout_s + 10):
            while final_version not in self.evaluated or self.running is not None:
                await self._changed.wait()
        if final_version not in self.evaluated:
            log.warning("%s: the final evaluation (version %d) did not finish", self.worker, final_version)

    async def play_round(self, version: int) -> EvalResult:
        ev = self.ev
        started = time.monotonic()
        outcomes: dict[tuple[int, int], tuple[Trajectory | EpisodeFailed, bool]] = {}
        with anyio.move_on_after(ev.timeout_s) as deadline:
            async with anyio.create_task_group() as tg:
                for i in range(ev.episodes):
                    for j in range(ev.samples):
                        tg.start_soon(self._play, version, i, j, outcomes)
        self.rounds += 1
        numbers = summarize(outcomes, ev.episodes, ev.samples)
        log.info(
            "%s: eval of version %d: reward %.3f success %.3f pass@%d %.3f (%.1fs)",
            self.worker,
            version,
            numbers["reward_mean"],
            numbers["success"],
            ev.samples,
            numbers["pass_at_k"],
            time.monotonic() - started,
        )
        return EvalResult(
            worker=self.worker,
            version=version,
            env=self.env_name,
            problems=ev.episodes,
            samples=ev.samples,
            duration_s=time.monotonic() - started,
            timed_out=deadline.cancelled_caught,
            **numbers,
        )

    async def _play(
        self,
        version: int,
        problem: int,
        sample: int,
        outcomes: dict[tuple[int, int], tuple[Trajectory | EpisodeFailed, bool]],
    ) -> None:
        gid = f"eval{version}-p{problem}"
        spec = EpisodeSpec(
            f"{gid}-s{sample}", gid, self.ev.seed + problem, sample, self.ev.samples, self.env_name
        )
        async with self.limiter:
            env = _Recording(make_env(self.env_name, self.env_args))
            try:
                result = await run_episode(
                    spec,
                    env,
                    self.chat,
                    self.client,
                    self.pool,
                    self.max_model_len(),
                    deadlines=self.client.deadlines,
                )
            except Exception as exc:  # a bug of ours: counted, the round goes on
                log.exception("eval episode %s crashed", spec.episode_id)
                result = EpisodeFailed(spec.episode_id, gid, self.ev.samples, Cause.ENVPOOL_ERROR, str(exc))
            finally:
                self.client.release(spec.episode_id)
        outcomes[(problem, sample)] = (result, env.success)

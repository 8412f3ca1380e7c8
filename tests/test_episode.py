"""One episode against the real actor: token-in/token-out bookkeeping and failure causes."""

import anyio
import pytest

from envpool.chat import ChatFormat
from envpool.client import ActorClient
from envpool.envs import Observation, StepResult, make_env
from envpool.episode import EpisodeSpec, run_episode
from shared.config import EnvPoolConfig, TransportConfig
from shared.protocol import EpisodeFailed, Trajectory
from shared.transport import open_channel


def play(actor, env, **cfg):
    chat = ChatFormat.from_model_dir(actor.model_dir)
    spec = EpisodeSpec("e0", "g0", seed=11, member=0, group_size=1, env_name="test")

    async def main():
        channel = open_channel("dealer", actor.address, bind=False, cfg=TransportConfig())
        client = ActorClient(channel, "episode-test")
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.run)
            result = await run_episode(spec, env, chat, client, EnvPoolConfig(**cfg), 1024)
            tg.cancel_scope.cancel()
        return result

    return anyio.run(main, backend="trio"), chat


def test_multi_turn_trajectory_is_consistent(actor):
    traj, chat = play(actor, make_env("evenchars", {"turns": 3}), max_tokens=8)
    assert isinstance(traj, Trajectory) and traj.num_turns == 3
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n
    generated = {i for s, e in zip(traj.turn_starts, traj.turn_ends) for i in range(s, e)}
    assert generated == {i for i, m in enumerate(traj.loss_mask) if m}
    assert all(traj.versions[i] >= 0 and traj.logprobs[i] <= 0 for i in generated)
    assert all(traj.versions[i] == -1 and traj.logprobs[i] == 0 for i in range(n) if i not in generated)
    assert traj.anchors == ["turn0", "turn1", "turn2"]
    assert traj.reward == pytest.approx(sum(traj.turn_rewards))
    # Each turn's reward is computed from exactly the tokens the model generated in that turn.
    for (s, e), r in zip(zip(traj.turn_starts, traj.turn_ends), traj.turn_rewards):
        text = chat.decode(traj.token_ids[s:e])
        share = sum(1 for c in text if ord(c) % 2 == 0) / len(text) if text else 0.0
        assert r == pytest.approx(share / 3)
    # The context starts with the rendered first prompt, untouched.
    assert traj.token_ids[: traj.turn_starts[0]] == chat.first_prompt("", "Write anything.")


class Broken:
    system_prompt = ""

    def __init__(self, where, how):
        self.where, self.how = where, how

    async def _fault(self, where):
        if where == self.where:
            if self.how == "raise":
                raise ValueError("boom")
            await anyio.sleep(60)

    async def reset(self, seed):
        await self._fault("reset")
        return Observation("go", "s0")

    async def step(self, action):
        await self._fault("step")
        return StepResult(Observation("", "s1"), 1.0, True, {})


@pytest.mark.parametrize("where", ["reset", "step"])
@pytest.mark.parametrize("how, cause", [("raise", "env_error"), ("hang", "env_timeout")])
def test_environment_faults_end_the_episode_with_a_cause(actor, where, how, cause):
    result, _ = play(actor, Broken(where, how), step_timeout_s=0.5, max_tokens=4)
    assert isinstance(result, EpisodeFailed)
    assert result.cause == cause and result.episode_id == "e0"
    assert where in result.message


def test_context_budget_truncates_instead_of_failing(actor):
    env = make_env("evenchars", {"turns": 50})
    traj, _ = play(actor, env, max_tokens=400, max_turns=50)
    assert isinstance(traj, Trajectory)
    assert len(traj.token_ids) <= 1024 and traj.num_turns < 50


def test_first_prompt_longer_than_context_is_a_named_failure(actor):
    env = make_env("evenchars", {"prompt": "word " * 1500})
    result, _ = play(actor, env)
    assert isinstance(result, EpisodeFailed) and result.cause == "prompt_too_long"

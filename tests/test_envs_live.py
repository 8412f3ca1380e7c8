"""Every registered environment, played for a few turns against the REAL vLLM actor.

The model is the tiny random one, so its replies are noise: these tests do not check that an
environment is learnable, but that every environment of the suite runs through the production
episode runner (`run_episode`, the `ActorClient`, the chat format) and yields a trajectory whose
bookkeeping is exact: token lists of one length, generated ranges that are exactly the actor's
tokens, a loss mask on the trained turns only, segments (fresh contexts) that open with the chat
prompt and the carried ids, each request's prompt being exactly the context the model may see,
and rewards, anchors, texts and invalid actions equal to what the environment answered.

The environment and the client are wrapped by thin recorders (what the environment was asked and
answered, what the actor was sent and returned); the recorders change nothing they pass on.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from helpers import keys_for

from millstream.envpool.actors.client import ActorClient, Generation
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import Observation, StepResult, env_names, make_env, parse_answer
from millstream.envpool.envs.agents.agent import is_agent_env
from millstream.envpool.envs.checks.echo import is_clean_reply
from millstream.envpool.envs.checks.evenchars import even_share
from millstream.envpool.episode import EpisodeSpec, run_episode
from millstream.shared.config import EnvPoolConfig, TransportConfig
from millstream.shared.wire import Trajectory
from millstream.shared.wire.transport import open_channel

MAX_TURNS = 3
MAX_TOKENS = 16
MAX_MODEL_LEN = 1024

#: Arguments per environment: the defaults, except where a default is random or too slow.
#: flaky: no crash or hang (they would make the episode a failure, tested elsewhere), and every
#: reply replaced by garbage, which the inner echo must count as an invalid action.
ENV_ARGS: dict[str, dict[str, Any]] = {
    "flaky": {"inner": "echo", "crash_prob": 0.0, "hang_prob": 0.0, "garbage_prob": 1.0},
    "pytool": {"timeout_s": 10.0},
    "dataset": {"path": "millstream:arithmetic"},
}

#: The format penalty of each environment of the suite with its default arguments (an invalid
#: trained action gets exactly this reward).
PENALTY = {
    "bandit": -0.1,
    "countdown": 0.0,
    "echo": -0.1,
    "flaky": -0.1,
    "frozenlake": -0.1,
    "guessnumber": -0.1,
    "markovian": -0.1,
    "pytool": -0.1,
    "search": -0.1,
    "sokoban": -0.1,
    "agentflow": -0.1,
}

#: Environments that always end after one turn.
ONE_TURN = {"bandit", "countdown", "noop"}


class RecordingEnv:
    """Passes every call to `inner` unchanged and remembers the calls and answers."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.system_prompt = getattr(inner, "system_prompt", "")
        self.observations: list[Observation] = []  # reset's observation, then each step's
        self.actions: list[str] = []
        self.results: list[StepResult] = []

    async def reset(self, seed):
        obs = await self.inner.reset(seed)
        self.observations.append(obs)
        return obs

    async def step(self, action):
        self.actions.append(action)
        result = await self.inner.step(action)
        self.results.append(result)
        self.observations.append(result.observation)
        return result


class RecordingClient:
    """The production client, remembering each request's prompt and each generation."""

    def __init__(self, client: ActorClient) -> None:
        self.client = client
        self.prompts: list[list[int]] = []
        self.generations: list[Generation] = []

    async def generate(self, prompt_token_ids, sampling, **kwargs):
        self.prompts.append(list(prompt_token_ids))
        gen = await self.client.generate(prompt_token_ids, sampling, **kwargs)
        self.generations.append(gen)
        return gen


def play_live(actor, env, seed=11, **cfg):
    chat = ChatFormat.from_model_dir(actor.model_dir)
    spec = EpisodeSpec("e0", "g0", seed=seed, member=0, group_size=1, env_name="live")
    recorder = RecordingEnv(env)
    box = {}

    async def main():
        channel = open_channel(
            "dealer", actor.address, bind=False, cfg=TransportConfig(), keys=keys_for("envpool")
        )
        client = RecordingClient(ActorClient(channel, "envs-live"))
        box["client"] = client
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.client.run)
            result = await run_episode(spec, recorder, chat, client, EnvPoolConfig(**cfg), MAX_MODEL_LEN)
            tg.cancel_scope.cancel()
        return result

    result = anyio.run(main, backend="trio")
    return result, chat, recorder, box["client"]


def check_consistent(
    traj: Trajectory, chat: ChatFormat, env: RecordingEnv, client: RecordingClient, max_turns: int
) -> None:
    """Everything a trajectory must satisfy whatever the model wrote."""
    n = len(traj.token_ids)
    assert n > 0
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n
    turns = traj.num_turns
    assert 1 <= turns <= max_turns
    assert (
        turns
        == len(traj.turn_rewards)
        == len(traj.anchors)
        == len(traj.turn_starts)
        == len(traj.turn_ends)
        == len(env.results)
        == len(env.actions)
        == len(client.generations)
    )
    # The episode ended by the environment or by the turn limit (the context is far from full).
    assert env.results[-1].done or turns == max_turns
    assert all(not r.done for r in env.results[:-1])

    # Rewards, anchors, texts and invalid actions are what the environment answered.
    assert traj.turn_rewards == [float(r.reward) for r in env.results]
    assert traj.reward == pytest.approx(sum(traj.turn_rewards))
    acting = env.observations[:turns]  # the observation each turn answered
    assert traj.anchors == [obs.anchor for obs in acting]
    assert traj.invalid_actions == sum(1 for r in env.results if not r.info.get("valid", True))
    expected_texts = [env.observations[0].text]
    for action, result in zip(env.actions, env.results):
        expected_texts += [action, result.observation.text]
    assert traj.texts == expected_texts

    # Generated ranges hold exactly the actor's tokens, logprobs and versions.
    generated: set[int] = set()
    for t, (s, e) in enumerate(zip(traj.turn_starts, traj.turn_ends)):
        gen = client.generations[t]
        assert 0 < s < e <= n
        if t:
            assert s > traj.turn_ends[t - 1]  # a prompt (bridge or fresh context) in between
        assert traj.token_ids[s:e] == gen.token_ids
        assert traj.logprobs[s:e] == gen.logprobs
        assert traj.versions[s:e] == gen.versions
        assert len(gen.token_ids) <= MAX_TOKENS
        assert all(v >= 0 for v in gen.versions)
        assert all(lp <= 0 for lp in gen.logprobs)
        assert env.actions[t] == chat.decode(gen.token_ids)
        want = 1 if acting[t].trained else 0
        assert traj.loss_mask[s:e] == [want] * (e - s), f"turn {t} trained={acting[t].trained}"
        generated.update(range(s, e))
    for i in range(n):
        if i not in generated:
            assert (traj.loss_mask[i], traj.logprobs[i], traj.versions[i]) == (0, 0.0, -1), i

    # Contexts: the first opens with the first prompt; each later turn's context is either the
    # previous one extended by the bridge, or (new_context) a fresh segment of the first prompt
    # of that observation plus the carried ids. Each request's prompt is exactly the segment so far.
    seg = traj.segment_starts
    assert seg == sorted(set(seg)) and all(0 < s < n for s in seg)
    system = env.system_prompt
    first = chat.first_prompt(system, acting[0].text)
    assert traj.token_ids[: traj.turn_starts[0]] == first
    segment_start, k = 0, 0
    carried: list[int] = []
    # An episode cut by max_turns: the runner currently appends the prompt of the turn that is
    # never played (see test_episode.py::test_nothing_follows_the_last_reply). Accept exactly
    # that prompt, or nothing.
    tail = len(traj.token_ids) > traj.turn_ends[-1]
    assert not (tail and env.results[-1].done)
    for t in range(turns + 1 if tail else turns):
        obs, end = env.observations[t], traj.turn_starts[t] if t < turns else n
        if t and obs.new_context:
            segment_start = seg[k]
            k += 1
            assert segment_start == traj.turn_ends[t - 1]
            reply = [i for i in carried + client.generations[t - 1].token_ids if i not in chat.stop_token_ids]
            carry = reply[len(reply) - obs.carry_tokens :] if obs.carry_tokens else []
            opening = chat.first_prompt(system, obs.text)
            assert traj.token_ids[segment_start:end] == opening + carry
            assert traj.loss_mask[segment_start] == 0
            carried = carry
        elif t:
            bridge = chat.close_turn(client.generations[t - 1].token_ids) + chat.next_prompt(obs.text)
            assert traj.token_ids[traj.turn_ends[t - 1] : end] == bridge
            carried = []
        if t < turns:
            assert client.prompts[t] == traj.token_ids[segment_start:end]
            assert len(client.prompts[t]) + len(client.generations[t].token_ids) <= MAX_MODEL_LEN
    assert k == len(seg)  # every segment is one of the fresh contexts above


def check_rules(name: str, traj: Trajectory, env: RecordingEnv) -> None:
    """What the environment's rules make knowable from the replies alone."""
    turns = traj.num_turns
    if name in ONE_TURN:
        assert turns == 1 and env.results[0].done
    if name == "noop":
        assert traj.turn_rewards == [0.0] and traj.invalid_actions == 0
    if name == "evenchars":  # two turns by default, each worth its even share / 2
        assert turns == 2
        for action, r in zip(env.actions, traj.turn_rewards):
            assert r == pytest.approx(even_share(action) / 2)
    if name == "echo":  # two turns, 1/2 for a clean reply, the penalty otherwise
        assert turns == 2
        for action, r in zip(env.actions, traj.turn_rewards):
            assert r == (0.5 if is_clean_reply(action) else -0.1)
        assert traj.invalid_actions == sum(1 for a in env.actions if not is_clean_reply(a))
    if name == "flaky":  # every reply became garbage: every turn invalid
        assert turns == 2 and traj.turn_rewards == [-0.1, -0.1] and traj.invalid_actions == 2
    if name == "bandit":
        answer = parse_answer(env.actions[0])
        arm = answer[0].strip().lower() if answer else None
        valid = arm in ("phoenix", "dragon")
        assert traj.invalid_actions == (0 if valid else 1)
        if not valid:
            assert traj.reward == -0.1
        elif arm == "phoenix":
            assert traj.reward == 0.1
        else:
            assert traj.reward in (0.0, 1.0)
    if name == "markovian":  # no answer tag: the chunks continue, each in a fresh context
        for t, result in enumerate(env.results):
            if "<answer>" not in env.actions[t] and not result.done:
                assert result.observation.new_context and result.observation.carry_tokens == 8
    if name == "agentflow":  # every module call after the first is a fresh context, no carry
        assert all(obs.new_context and obs.carry_tokens == 0 for obs in env.observations[1:-1])
    if name in PENALTY:
        for t, result in enumerate(env.results):
            if not result.info.get("valid", True) and env.observations[t].trained:
                assert result.reward == PENALTY[name], (t, result)


# Agent environments (run, no step) play through their endpoint: tests/test_openai_endpoint.py.
@pytest.mark.parametrize("name", [n for n in env_names() if not is_agent_env(make_env(n, ENV_ARGS.get(n)))])
def test_env_plays_consistent_episodes_on_the_real_actor(actor, name):
    args = ENV_ARGS.get(name, {})
    for seed in (11, 12):
        traj, chat, env, client = play_live(
            actor,
            make_env(name, args),
            seed=seed,
            max_turns=MAX_TURNS,
            max_tokens=MAX_TOKENS,
            step_timeout_s=30.0,
        )
        assert isinstance(traj, Trajectory), traj
        assert traj.env == "live" and traj.seed == seed and traj.group_size == 1
        check_consistent(traj, chat, env, client, MAX_TURNS)
        check_rules(name, traj, env)


def test_markovian_chunks_are_fresh_segments_on_the_real_actor(actor):
    """Delethink through the real actor: every unfinished chunk opens a new segment."""
    env = make_env("markovian", {"max_chunks": 3, "carry_tokens": 4})
    traj, chat, rec, client = play_live(actor, env, max_turns=3, max_tokens=MAX_TOKENS)
    assert isinstance(traj, Trajectory)
    check_consistent(traj, chat, rec, client, 3)
    unfinished = [r for r in rec.results if not r.done]
    assert len(traj.segment_starts) == len(unfinished)
    if traj.num_turns == 3 and not any("<answer>" in a for a in rec.actions):
        assert len(traj.segment_starts) == 2 and rec.results[-1].info.get("truncated") is True

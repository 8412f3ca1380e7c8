"""The per-episode OpenAI-compatible endpoint (envpool/agents/endpoint.py), driven by the official
`openai` client (sync and async, streamed and not, with tools), against the synthetic actor
(actor/synthetic.py: these tests are about the endpoint's recording, not about a model) or a
scripted client where exact token ids are needed; and the `<tool_call>` parser."""

import json

import anyio
import openai
import pytest
from helpers import Recorder, keys_for
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.envpool.actors.client import ActorClient, Generation
from millstream.envpool.agents.endpoint import MODEL_NAME, Endpoint
from millstream.envpool.agents.episode import run_agent_episode
from millstream.envpool.agents.toolcalls import parse_tool_calls
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import make_env
from millstream.envpool.envs.agents.agent import AgentResult
from millstream.envpool.envs.agents.openai_agent import SCORE_TOOL
from millstream.envpool.episode import EpisodeSpec
from millstream.shared.config import EnvPoolConfig, TransportConfig
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory
from millstream.shared.wire.transport import open_channel

STOP = 2  # <|im_end|> of the tiny model


class ScriptedClient:
    """Answers the k-th request with `replies[k]` (exact token ids) and records."""

    def __init__(self, replies):
        self.replies, self.prompts, self.generations, self.seeds = replies, [], [], []

    async def generate(self, prompt_token_ids, sampling, seed=None, **_):
        ids = list(self.replies[len(self.prompts)][: sampling.max_tokens])
        self.prompts.append(list(prompt_token_ids))
        self.seeds.append(seed)
        top = (
            [[(t, -0.25), (t + 1, -3.0)][: sampling.top_logprobs] for t in ids]
            if sampling.top_logprobs
            else []
        )
        gen = Generation(ids, [-0.25] * len(ids), [7] * len(ids), "stop", top)
        self.generations.append(gen)
        return gen


SPEC = EpisodeSpec("g0-e0", "g0", seed=11, member=0, group_size=1, env_name="test")


async def _play(chat, client, agent, cfg, max_model_len=1024):
    endpoint = Endpoint(chat, client, cfg, lambda: max_model_len)
    async with anyio.create_task_group() as tg:
        await tg.start(endpoint.serve)
        result = await run_agent_episode(SPEC, agent, endpoint, cfg)
        tg.cancel_scope.cancel()
    return result


def play_synthetic(address, model_dir, agent, **cfg):
    """One agent episode against the synthetic actor; returns (result, recorder, chat)."""
    chat = ChatFormat.from_model_dir(model_dir)
    box = {}

    async def main():
        channel = open_channel("dealer", address, bind=False, cfg=TransportConfig(), keys=keys_for("envpool"))
        client = Recorder(ActorClient(channel, "endpoint-test"))
        box["client"] = client
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.client.run)
            result = await _play(chat, client, agent, EnvPoolConfig(**cfg))
            tg.cancel_scope.cancel()
        return result

    return anyio.run(main, backend="trio"), box["client"], chat


def play_scripted(model_dir, agent, replies, **cfg):
    chat = ChatFormat.from_model_dir(model_dir)
    client = ScriptedClient(replies)
    return anyio.run(_play, chat, client, agent, EnvPoolConfig(**cfg), backend="trio"), client, chat


def assert_recorded_as_sampled(traj: Trajectory, client) -> None:
    """Every call's generation sits in the trajectory exactly (ids, logprobs, versions, mask 1),
    right after the prompt the actor was given (within its segment)."""
    assert traj.num_turns == len(client.generations) > 0
    bounds = [0, *traj.segment_starts]
    for k, (gen, prompt) in enumerate(zip(client.generations, client.prompts)):
        start, end = traj.turn_starts[k], traj.turn_ends[k]
        assert traj.token_ids[start:end] == gen.token_ids
        assert traj.logprobs[start:end] == gen.logprobs
        assert traj.versions[start:end] == gen.versions
        assert traj.loss_mask[start:end] == [1] * len(gen.token_ids)
        segment = max(b for b in bounds if b <= start)
        assert traj.token_ids[segment:start] == prompt
        added = max(segment, traj.turn_ends[k - 1] if k else 0)  # what this call's prompt added
        assert set(traj.loss_mask[added:start]) <= {0}
    assert sum(traj.loss_mask) == sum(len(g.token_ids) for g in client.generations)


# --- the official client, async and sync, against the synthetic actor -------------------------


class AsyncToolAgent:
    """AsyncOpenAI on the worker's trio loop: a forced tool call, the tool's result, a streamed
    final answer, and the model list."""

    def __init__(self):
        self.seen = {}

    async def run(self, seed, base_url, api_key):
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=30
        ) as client:
            self.seen["models"] = [m.id for m in (await client.models.list()).data]
            messages = [{"role": "user", "content": "Score a word."}]
            first = await client.chat.completions.create(
                model="any",
                messages=messages,
                tools=[SCORE_TOOL],
                tool_choice={"type": "function", "function": {"name": "score_word"}},
            )
            reply = first.choices[0].message
            self.seen["first"] = first
            messages.append(reply.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "0.5"})
            stream = await client.chat.completions.create(
                model="any", messages=messages, tools=[SCORE_TOOL], stream=True
            )
            self.seen["chunks"] = [chunk async for chunk in stream]
        return AgentResult(0.75, {"valid": True})


def test_async_client_tool_call_and_stream_are_recorded_as_sampled(synthetic, tiny_model_dir):
    agent = AsyncToolAgent()
    traj, client, chat = play_synthetic(synthetic, tiny_model_dir, agent, max_tokens=8)
    assert isinstance(traj, Trajectory), traj
    assert agent.seen["models"] == [MODEL_NAME]
    first = agent.seen["first"]
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "score_word"
    assert (
        json.loads(call.function.arguments)["text"]
        == chat.decode(client.generations[0].token_ids).split('"')[0]
    )
    # The forced call's opening is prompt (no loss), the model's argument is generated.
    assert chat.decode(client.prompts[0]).endswith(
        '<tool_call>\n{"name": "score_word", "arguments": {"text": "'
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in agent.seen["chunks"] if c.choices)
    assert streamed.strip() == chat.decode(client.generations[1].token_ids).strip()
    assert traj.reward == 0.75 and traj.turn_rewards == [0.0, 0.75]
    assert_recorded_as_sampled(traj, client)


class SyncAgent:
    """The sync OpenAI client in a worker thread: a chat call, a streamed chat call, and a
    completion from token ids; the second call does not extend the first's context."""

    def __init__(self):
        self.seen = {}

    async def run(self, seed, base_url, api_key):
        return await anyio.to_thread.run_sync(self._run, base_url, api_key)

    def _run(self, base_url, api_key):
        with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as client:
            one = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "One."}])
            self.seen["one"] = one.choices[0].message.content
            stream = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Two."}], stream=True, max_tokens=4
            )
            self.seen["two"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            three = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=3)
            self.seen["three"] = three.choices[0].text
            self.seen["usage"] = three.usage
        return AgentResult(1.0)


def test_sync_client_and_non_extending_calls_start_segments(synthetic, tiny_model_dir):
    agent = SyncAgent()
    traj, client, _ = play_synthetic(synthetic, tiny_model_dir, agent, max_tokens=8)
    assert isinstance(traj, Trajectory), traj
    assert traj.num_turns == 3 and len(client.generations[1].token_ids) <= 4
    assert client.prompts[2] == [5, 6, 7] and agent.seen["usage"].prompt_tokens == 3
    # None of the three prompts continues the context before it: three segments.
    assert traj.segment_starts == [traj.turn_ends[0], traj.turn_ends[1]]
    assert_recorded_as_sampled(traj, client)


# --- exact ids: an extending call appends ------------------------------------------------------


class TwoTurnChat:
    async def run(self, seed, base_url, api_key):
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=30
        ) as client:
            messages = [{"role": "user", "content": "Hi."}]
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And?"},
            ]
            await client.chat.completions.create(model="m", messages=messages)
        return AgentResult(0.5)


def test_a_call_that_extends_the_context_is_appended(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    hello = chat.encode("hello there") + [STOP]
    traj, client, _ = play_scripted(tiny_model_dir, TwoTurnChat(), [hello, hello])
    assert isinstance(traj, Trajectory), traj
    assert traj.segment_starts == []  # one context: the second prompt extends the first
    assert client.prompts[1][: len(client.prompts[0]) + len(hello)] == client.prompts[0] + hello
    assert_recorded_as_sampled(traj, client)


# --- refusals: n too large, unknown episode, wrong key, failures as causes ---------------------------


class Refused:
    def __init__(self):
        self.errors = {}

    async def run(self, seed, base_url, api_key):
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, timeout=30
        ) as client:
            msgs = [{"role": "user", "content": "x"}]
            for name, call in {
                "n": lambda: client.chat.completions.create(model="m", messages=msgs, n=99),
                "n_budget": lambda: client.chat.completions.create(model="m", messages=msgs, n=2),
                "unknown": lambda: client.with_options(
                    base_url=base_url.replace("g0-e0", "nope")
                ).models.list(),
                "key": lambda: client.with_options(api_key="wrong").models.list(),
                "big": lambda: client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x" * 70_000}]
                ),
                "ok": lambda: client.chat.completions.create(model="m", messages=msgs),
                "calls": lambda: client.chat.completions.create(model="m", messages=msgs),
            }.items():
                try:
                    await call()
                except openai.APIStatusError as exc:
                    self.errors[name] = (exc.status_code, exc.body)
        return AgentResult(0.0)


def test_n_too_large_unknown_episode_wrong_key_and_bounds_are_refused(tiny_model_dir):
    agent = Refused()
    traj, client, _ = play_scripted(
        tiny_model_dir, agent, [[STOP]], max_turns=1, agent_max_request_bytes=65536
    )
    assert isinstance(traj, Trajectory) and len(client.prompts) == 1  # refusals never generate
    status, body = agent.errors["n"]
    assert status == 400 and body["param"] == "n" and "99" in body["message"]
    # n samples are n calls of the episode: two do not fit in max_turns=1.
    assert agent.errors["n_budget"][0] == 400 and "max_turns" in agent.errors["n_budget"][1]["message"]
    assert agent.errors["unknown"][0] == 404 and agent.errors["unknown"][1]["type"] == "not_found_error"
    assert agent.errors["key"][0] == 401
    assert agent.errors["big"][0] == 413 and "agent_max_request_bytes" in agent.errors["big"][1]["message"]
    assert "ok" not in agent.errors  # one call allowed (max_turns=1), the next refused
    assert agent.errors["calls"][0] == 400 and "max_turns" in agent.errors["calls"][1]["message"]


class Raises:
    async def run(self, seed, base_url, api_key):
        raise RuntimeError("agent bug")


class Hangs:
    async def run(self, seed, base_url, api_key):
        await anyio.sleep(60)


class Silent:
    async def run(self, seed, base_url, api_key):
        return AgentResult(1.0)


@pytest.mark.parametrize(
    "agent, cause",
    [(Raises(), Cause.ENV_ERROR), (Hangs(), Cause.EPISODE_TIMEOUT), (Silent(), Cause.ENV_ERROR)],
)
def test_agent_failures_are_counted_causes(tiny_model_dir, agent, cause):
    result, _, _ = play_scripted(tiny_model_dir, agent, [], episode_timeout_s=0.5)
    assert isinstance(result, EpisodeFailed) and result.cause == cause
    if not isinstance(agent, Silent):  # the store keeps the agent's seed and how long it ran
        assert result.scene is not None and result.scene.seed == SPEC.seed and result.scene.token_ids == []


def test_the_example_agent_calls_its_tool_and_is_scored(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    word, answer = chat.encode('bdf"') + [STOP], chat.encode("bb") + [STOP]
    traj, client, _ = play_scripted(tiny_model_dir, make_env("openai_agent"), [word, answer])
    assert isinstance(traj, Trajectory), traj
    assert "tool\n1.00" in chat.decode(client.prompts[1])  # the tool's result reached the model
    assert traj.reward == pytest.approx(0.5 * 1.0 + 0.5 * 1.0)  # "bdf" and "bb": all even
    assert_recorded_as_sampled(traj, client)


# --- the <tool_call> parser ----------------------------------------------------------------------


def test_tool_call_blocks_become_openai_tool_calls():
    text = (
        'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
        '<tool_call>{"name": "g"}</tool_call>'
    )
    parsed = parse_tool_calls(text, "3")
    assert parsed.content == "ok" and parsed.malformed == 0
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f", "g"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    assert parsed.tool_calls[1]["function"]["arguments"] == "{}" and parsed.tool_calls[1]["id"] == "call_3_1"


def test_malformed_tool_calls_stay_content_and_are_counted():
    text = 'a <tool_call>{"name": "f", "arguments": {</tool_call> b <tool_call>[1]</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == [] and parsed.malformed == 2 and parsed.content == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}[]":, tool_cal namergs\\1')), max_size=80))
def test_the_parser_never_raises(text):
    parsed = parse_tool_calls("<tool_call>" + text)
    assert parsed.malformed + len(parsed.tool_calls) >= 1


def test_an_agent_reward_that_is_not_a_number_fails_the_episode(tiny_model_dir):
    """A NaN reward from an agent environment is its failure (env_error), never a score: the
    learner refused it in training, but evaluation took it into its means."""

    class NanAgent:
        async def run(self, seed, base_url, api_key):
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
            return AgentResult(float("nan"))

    chat = ChatFormat.from_model_dir(tiny_model_dir)
    failed, _, _ = play_scripted(
        tiny_model_dir, NanAgent(), [chat.encode("Yes.") + [chat.eos_id]], max_tokens=8
    )
    assert isinstance(failed, EpisodeFailed) and failed.cause == Cause.ENV_ERROR
    assert "returned the reward nan" in failed.message

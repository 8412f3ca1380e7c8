"""Every request field of the agent endpoint is honoured as `vllm serve` honours it, or refused
with a 400 that names it (envpool/agents/requests.py): driven by the official `openai` client
against a scripted client that returns exact token ids (these tests are about the endpoint)."""

import json

import anyio
import openai
import pytest
from test_openai_endpoint import STOP, ScriptedClient, assert_recorded_as_sampled, play_scripted

from millstream.envpool.agents.requests import ApiError, RunSampling, parse_chat
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs.agents.agent import AgentResult
from millstream.envpool.envs.agents.openai_agent import SCORE_TOOL
from millstream.shared.wire import Trajectory

RUN = RunSampling(max_tokens=8, temperature=1.0, top_p=1.0)
USER = [{"role": "user", "content": "x"}]


class Script:
    """An agent that runs `script(client)` with the official async client and keeps what it
    returned; an API error ends the script and is kept as (status, body)."""

    def __init__(self, script):
        self.script, self.out, self.error = script, None, None

    async def run(self, seed, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as c:
            try:
                self.out = await self.script(c)
            except openai.APIStatusError as exc:
                self.error = (exc.status_code, exc.body)
        return AgentResult(1.0)


def play_format(chat, script, replies):
    """`script` against the endpoint on a `ChatFormat` of the test's own; (agent, client)."""
    from test_openai_endpoint import _play

    from millstream.shared.config import EnvPoolConfig

    agent, client = Script(script), ScriptedClient(replies)
    anyio.run(_play, chat, client, agent, EnvPoolConfig(max_tokens=8), backend="trio")
    return agent, client


def play(tiny_model_dir, script, replies, **cfg):
    agent = Script(script)
    traj, client, chat = play_scripted(tiny_model_dir, agent, replies, **{"max_tokens": 8, **cfg})
    return agent, traj, client, chat


# --- refused, naming the field ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"max_token": 5}, "max_token"),  # a typo is not dropped
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": False}, "presence_penalty"),  # a boolean is not the number 0
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_k": 5}, "top_k"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # top_logprobs without logprobs
        ({"n": 0}, "n"),
        ({"stop": [1, 2]}, "stop"),
        ({"seed": "7"}, "seed"),
        ({"tool_choice": "required"}, "tool_choice"),  # required without tools
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_a_field_the_endpoint_cannot_honour_is_a_400_naming_it(fields, named):
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": USER, **fields}, RUN)
    assert caught.value.status == 400 and caught.value.param == named and named in str(caught.value)


def test_a_run_may_override_the_sampling_agents_send():
    loose = RunSampling(max_tokens=8, temperature=1.0, top_p=1.0, strict=False)
    assert parse_chat({"messages": USER, "temperature": 0.7, "top_p": 0.9}, loose).options.n == 1
    with pytest.raises(ApiError, match="frequency_penalty"):  # the other controls stay refused
        parse_chat({"messages": USER, "frequency_penalty": 0.5}, loose)


def test_greedy_runs_refuse_n_above_one_as_vllm_does():
    greedy = RunSampling(max_tokens=8, temperature=0.0, top_p=1.0)
    with pytest.raises(ApiError, match="n must be 1 when using greedy sampling"):
        parse_chat({"messages": USER, "n": 2}, greedy)
    assert parse_chat({"messages": USER, "n": 1, "temperature": 0}, greedy).options.n == 1


def test_neutral_values_and_metadata_are_accepted():
    req = parse_chat(
        {
            "messages": USER,
            "model": "anything",
            "user": "u1",
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "response_format": {"type": "text"},
            "temperature": 1,
            "top_p": 1.0,
            "max_completion_tokens": 5,
            "max_tokens": 99,  # max_completion_tokens wins, as in vLLM
            "parallel_tool_calls": True,
        },
        RUN,
    )
    assert req.options.max_tokens == 5 and req.tool_choice == "none"


def test_refusals_reach_the_client_and_generate_nothing(tiny_model_dir):
    async def script(c):
        await c.chat.completions.create(model="m", messages=USER, extra_body={"guided_json": {}})

    agent, _, client, _ = play(tiny_model_dir, script, [])
    status, body = agent.error
    assert status == 400 and body["param"] == "guided_json" and client.prompts == []


# --- honoured -------------------------------------------------------------------------------------


def test_stop_strings_end_the_reply_and_the_record_where_vllm_would(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    reply = chat.encode("ab. cd. ef") + [STOP]

    async def script(c):
        plain = await c.chat.completions.create(model="m", messages=USER, stop=["."])
        kept = await c.chat.completions.create(
            model="m", messages=USER, stop=".", extra_body={"include_stop_str_in_output": True}
        )
        done = await c.completions.create(model="m", prompt="x", stop=[" cd", "zz"])
        streamed = await c.chat.completions.create(model="m", messages=USER, stop=["."], stream=True)
        return plain, kept, done, [k async for k in streamed]

    agent, traj, _, _ = play(tiny_model_dir, script, [reply] * 4)
    plain, kept, done, chunks = agent.out
    assert plain.choices[0].message.content == "ab" and plain.choices[0].finish_reason == "stop"
    assert plain.model_extra is not None and plain.choices[0].model_extra["stop_reason"] == "."
    assert kept.choices[0].message.content == "ab."
    assert done.choices[0].text == "ab." and done.choices[0].finish_reason == "stop"
    assert "".join(k.choices[0].delta.content or "" for k in chunks if k.choices) == "ab"
    # The record keeps the fewest sampled tokens whose text holds the stop: a prefix of the reply.
    for k, text in ((0, "ab."), (2, "ab. cd")):
        recorded = traj.token_ids[traj.turn_starts[k] : traj.turn_ends[k]]
        assert recorded == reply[: len(recorded)] and chat.decode(recorded).endswith(text[-1])
        assert text in chat.decode(recorded) and text not in chat.decode(recorded[:-1])
    assert plain.usage.completion_tokens == traj.turn_ends[0] - traj.turn_starts[0] < len(reply)


def test_a_request_seed_repeats_within_the_episode_and_members_still_differ(tiny_model_dir):
    async def script(c):
        for seed in (7, 7, 8, None, None):
            await c.chat.completions.create(model="m", messages=USER, seed=seed)

    _, _, client, _ = play(tiny_model_dir, script, [[STOP]] * 5, max_turns=5)
    s7, s7b, s8, own1, own2 = client.seeds
    assert s7 == s7b and len({s7, s8, own1, own2}) == 4
    from millstream.envpool.seeds import request_seed

    assert request_seed(11, 0, 7, 0) != request_seed(11, 1, 7, 0)  # another member, another sample


def test_logprobs_token_ids_echo_and_n(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    reply = chat.encode("ab") + [STOP]

    async def script(c):
        chat_lp = await c.chat.completions.create(
            model="m", messages=USER, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True}
        )
        comp = await c.completions.create(model="m", prompt="xy", logprobs=1)
        echoed = await c.completions.create(model="m", prompt="xy", echo=True)
        three = await c.chat.completions.create(model="m", messages=USER, n=3)
        try:  # echo with logprobs would need the prompt's logprobs, which are not computed
            await c.completions.create(model="m", prompt="xy", echo=True, logprobs=0)
        except openai.BadRequestError as exc:
            refused = exc.body["param"]
        return chat_lp, comp, echoed, three, refused

    agent, traj, client, _ = play(tiny_model_dir, script, [reply] * 6, max_turns=6)
    chat_lp, comp, echoed, three, refused = agent.out
    assert refused == "echo" and echoed.choices[0].text == "xyab"
    content = chat_lp.choices[0].logprobs.content
    assert [t.logprob for t in content] == [-0.25] * len(reply)
    # The most likely tokens, as the actor ranked them (the scripted client: the sampled one,
    # then the next id at -3.0).
    first = content[0].top_logprobs
    assert [(x.token, x.logprob) for x in first] == [
        (chat.decode([reply[0]]), -0.25),
        (chat.decode([reply[0] + 1]), -3.0),
    ]
    assert comp.choices[0].logprobs.top_logprobs[0] == {chat.decode([reply[0]]): -0.25}
    assert "".join(t.token for t in content).startswith("ab")
    assert chat_lp.choices[0].model_extra["token_ids"] == reply
    assert chat_lp.model_extra["prompt_token_ids"] == client.prompts[0]
    assert comp.choices[0].text == "ab" and comp.choices[0].logprobs.token_logprobs == [-0.25] * len(reply)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 3 * len(reply)
    assert client.prompts[3] == client.prompts[4] == client.prompts[5]
    assert len(set(client.seeds[3:])) == 3  # n samples, n seeds
    assert isinstance(traj, Trajectory) and traj.num_turns == 6
    assert_recorded_as_sampled(traj, client)


def test_tool_choice_none_required_and_parallel_calls(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    block = '<tool_call>\n{"name": "score_word", "arguments": {"text": "a"}}\n</tool_call>'
    two = chat.encode(block + block) + [STOP]
    rest = chat.encode('score_word", "arguments": {"text": "b"}}\n</tool_call>') + [STOP]
    tools = [SCORE_TOOL]

    async def script(c):
        none = await c.chat.completions.create(model="m", messages=USER, tools=tools, tool_choice="none")
        auto = await c.chat.completions.create(model="m", messages=USER, tools=tools)
        one = await c.chat.completions.create(
            model="m", messages=USER, tools=tools, parallel_tool_calls=False
        )
        required = await c.chat.completions.create(
            model="m", messages=USER, tools=tools, tool_choice="required"
        )
        return none, auto, one, required

    agent, _, client, _ = play(tiny_model_dir, script, [two, two, two, rest], max_tokens=400)
    none, auto, one, required = agent.out
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    assert len(auto.choices[0].message.tool_calls) == 2 and len(one.choices[0].message.tool_calls) == 1
    call = required.choices[0].message.tool_calls[0]
    assert call.function.name == "score_word" and call.function.arguments == '{"text": "b"}'
    assert chat.decode(client.prompts[3]).endswith('<tool_call>\n{"name": "')


def test_developer_is_system_and_template_kwargs_reach_the_template(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    thinking = ChatFormat(chat.tokenizer, template, chat.special_tokens)

    async def script(c):
        msgs = [{"role": "developer", "content": "Be brief."}, *USER]
        await c.chat.completions.create(model="m", messages=msgs)
        await c.chat.completions.create(
            model="m", messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )

    agent, client = play_format(thinking, script, [[STOP]] * 2)
    assert agent.error is None
    system = [{"role": "system", "content": "Be brief."}, *USER]
    assert client.prompts[0] == thinking.apply(system)
    assert client.prompts[1] == thinking.apply(system, template_kwargs={"enable_thinking": False})
    assert thinking.decode(client.prompts[1]).endswith("<think>\n\n</think>\n\n")


def test_a_forced_call_is_refused_for_a_template_with_its_own_tool_format(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    own = (
        "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    other = ChatFormat(chat.tokenizer, own, chat.special_tokens)
    assert other.renders_tools and not chat.renders_tools

    async def script(c):
        await c.chat.completions.create(model="m", messages=USER, tools=[SCORE_TOOL], tool_choice="required")

    agent, client = play_format(other, script, [])
    status, body = agent.error
    assert status == 400 and body["param"] == "tool_choice" and "format of its own" in body["message"]
    assert client.prompts == []


# --- odd but legal input, and degenerate model output: a 400 or a counted malformed call ---------


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": "f"}]}, "tools"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": 5}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
    ],
)
def test_malformed_tools_and_messages_are_a_400_not_a_500(fields, named):
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": USER, **fields}, RUN)
    assert caught.value.status == 400 and caught.value.param == named


def test_a_null_max_completion_tokens_leaves_max_tokens_in_force():
    assert (
        parse_chat({"messages": USER, "max_completion_tokens": None, "max_tokens": 5}, RUN).options.max_tokens
        == 5
    )


def test_degenerate_tool_calls_are_counted_malformed_never_raised():
    from millstream.envpool.agents.toolcalls import ForcedCall, parse_reply
    from millstream.envpool.agents.toolformats import FORMATS

    deep = '<tool_call>{"name":"f","arguments":"' + "[" * 5000 + '"}</tool_call>'
    for fmt, text in [("hermes", deep), ("pythonic", '[f(a=b"x")]'), ("pythonic", "[f(a={1, 2})]")]:
        reply = parse_reply(text, "auto", None, True, "0", FORMATS[fmt])
        assert reply.tool_calls == [] and reply.malformed == 1, fmt
    # A forced string argument is the JSON string the model wrote, unescaped, up to its quote.
    forced = ForcedCall('<tool_call>{"name": "f", "arguments": {"text": "', "f", "text")
    reply = parse_reply('say \\"hi\\"\\nok"}}</tool_call>', "function", forced, True, "0")
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"text": 'say "hi"\nok'}

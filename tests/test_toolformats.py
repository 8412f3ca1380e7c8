"""Tool calls in each family's own format (envpool/agents/toolformats.py), as vLLM's parsers name
them: each reads its family's calls, leaves other text as content, counts malformed calls, and
never raises; the endpoint picks the format from the template and hands each template the call
arguments in the form it reads (DeepSeek's: the JSON string)."""

import json

import anyio
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_openai_endpoint import STOP, ScriptedClient, _play

from millstream.envpool.agents.toolformats import FORMATS, detect, parse
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs.agents.agent import AgentResult
from millstream.shared.config import EnvPoolConfig

PARIS = {"city": "Paris"}


def calls_of(reply):
    calls = reply["tool_calls"] if isinstance(reply, dict) else reply.tool_calls
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls or []]


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        (
            "hermes",
            'Hi <tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Hi",
            [("w", PARIS)],
        ),
        ("llama3_json", '{"name": "w", "parameters": {"city": "Paris"}}', "", [("w", PARIS)]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "w", "parameters": {"city": "Paris"}}; {"name": "t", "parameters": {}}',
            "",
            [("w", PARIS), ("t", {})],
        ),
        (
            "mistral",
            'Sure.[TOOL_CALLS][{"name": "w", "arguments": {"city": "Paris"}}]',
            "Sure.",
            [("w", PARIS)],
        ),
        ("mistral", '[TOOL_CALLS]w[ARGS]{"city": "Paris"}', "", [("w", PARIS)]),
        ("granite", '<|tool_call|>[{"name": "w", "arguments": {"city": "Paris"}}]', "", [("w", PARIS)]),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>w\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "",
            [("w", PARIS)],
        ),
        (
            "deepseek_v3",
            'Ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>w<｜tool▁sep｜>{"city": "Paris"}'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Ok",
            [("w", PARIS)],
        ),
        (
            "qwen3_xml",
            "<tool_call>\n<function=w>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>",
            "",
            [("w", {"city": "Paris", "days": 3})],
        ),
        ("pythonic", '[w(city="Paris"), t()]', "", [("w", PARIS), ("t", {})]),
    ],
)
def test_each_family_reads_its_own_calls(fmt, text, content, calls):
    reply = parse(text, fmt, "3")
    assert reply.content == content and calls_of(reply) == calls and reply.malformed == 0
    assert len({c["id"] for c in reply.tool_calls}) == len(calls)


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("llama3_json", '{"name": 5, "parameters": {}}'),
        ("mistral", "[TOOL_CALLS][{oops"),
        ("granite", "<|tool_call|>not json"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>garbage"),
        ("pythonic", "[print(x)]"),  # a positional, non-literal argument is not a call
    ],
)
def test_a_malformed_call_stays_content_and_is_counted(fmt, text):
    reply = parse(text, fmt, "0")
    assert reply.tool_calls == [] and reply.content == text and reply.malformed == 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_plain_text_is_content(fmt):
    reply = parse("The weather is fine.", fmt, "0")
    assert reply.content == "The weather is fine." and reply.tool_calls == [] and reply.malformed == 0


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.text(max_size=200))
def test_no_parser_raises_on_model_output(fmt, text):
    parse(text, fmt, "0")


def test_mistral_ids_are_nine_alphanumerics():
    reply = parse(
        '[TOOL_CALLS][{"name": "w", "arguments": {}}, {"name": "t", "arguments": {}}]', "mistral", "2"
    )
    ids = [c["id"] for c in reply.tool_calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2


def test_the_format_is_read_from_the_template():
    assert detect("{{ '<tool_call>' }}") == "hermes"
    assert detect("<tool_call>\n<function={{ name }}>") == "qwen3_xml"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect("<|tool_call|>") == "granite"
    assert detect("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None


#: A DeepSeek-style template: it writes a call's arguments by string concatenation, so it needs
#: them as the JSON string OpenAI sends (a dict fails: "can only concatenate str").
DEEPSEEK_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n<｜tool▁calls▁begin｜>"
    "{% for t in m['tool_calls'] %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ t['function']['name'] }}\n"
    "```json\n{{ t['function']['arguments'] + '' }}\n```<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class RoundTrip:
    def __init__(self):
        self.calls, self.error = [], None

    async def run(self, seed, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as c:
            msgs = [{"role": "user", "content": "Weather?"}]
            tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
            try:
                first = await c.chat.completions.create(model="m", messages=msgs, tools=tools)
                reply = first.choices[0].message
                self.calls = calls_of(reply.model_dump())
                msgs.append(reply.model_dump(exclude_none=True))
                msgs.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "sunny"})
                await c.chat.completions.create(model="m", messages=msgs, tools=tools)
            except openai.APIStatusError as exc:
                self.error = (exc.status_code, exc.body)
        return AgentResult(1.0)


def test_a_deepseek_template_gets_string_arguments_and_its_calls_are_parsed(tiny_model_dir):
    tiny = ChatFormat.from_model_dir(tiny_model_dir)
    chat = ChatFormat(tiny.tokenizer, DEEPSEEK_LIKE, tiny.special_tokens)
    call = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>w\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    client = ScriptedClient([chat.encode(call) + [STOP], [STOP]])
    agent = RoundTrip()
    anyio.run(_play, chat, client, agent, EnvPoolConfig(max_tokens=400), backend="trio")
    assert agent.error is None and agent.calls == [("w", PARIS)]
    assert len(client.prompts) == 2  # the second call rendered: the template got a string

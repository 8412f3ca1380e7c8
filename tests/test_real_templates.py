"""The real chat templates of 13 model families (tests/templates/real, SOURCES.md says where each
comes from), on the tiny tokenizer with each family's special tokens: `ChatFormat` loads every
one and renders the conversations agents send (system, multi-turn, tool call + result, thinking
on and off) token for token as transformers does, or refuses where transformers' render raises.
The endpoint reads each family's tool calls in its own format (`toolformats.detect`)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chat_templates import write_tokenizer_dir

from millstream.envpool.agents.messages import template_message
from millstream.envpool.agents.toolformats import detect
from millstream.envpool.chat import ChatFormat, ChatTemplateError

REAL = Path(__file__).parent / "templates" / "real"

CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
MISTRAL = [
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
DEEPSEEK = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]  # fmt: skip
LLAMA = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]

# family: (special tokens, plain added tokens, tokenizer_config changes, tool-call format)
FAMILIES = {
    "llama3.1": (LLAMA, [], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "llama3_json"),
    "llama3.2": (LLAMA, [], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "llama3_json"),
    "qwen2.5": (CHATML, ["<tool_call>", "</tool_call>"], {"eos_token": "<|im_end|>"}, "hermes"),
    "qwen3": (
        CHATML,
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        {"eos_token": "<|im_end|>"},
        "hermes",
    ),
    "mistral-v0.3": (MISTRAL, [], {"bos_token": "<s>", "eos_token": "</s>"}, "mistral"),
    "mistral-nemo": (MISTRAL, [], {"bos_token": "<s>", "eos_token": "</s>"}, "mistral"),
    "phi3.5": (
        ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"],
        [],
        {"eos_token": "<|endoftext|>"},
        None,
    ),
    "deepseek-r1": (
        DEEPSEEK,
        ["<think>", "</think>"],
        {"bos_token": DEEPSEEK[0], "eos_token": DEEPSEEK[1]},
        "deepseek_v3",
    ),
    "gemma3": (
        ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        [],
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        None,
    ),
    "smollm2": (CHATML, [], {"eos_token": "<|im_end|>"}, None),
    "smollm3": (
        CHATML,
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        {"eos_token": "<|im_end|>"},
        "hermes",
    ),
    "granite3": (
        ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"],
        [],
        {"eos_token": "<|end_of_text|>"},
        "granite",
    ),
    "command-r": (
        [
            "<BOS_TOKEN>",
            "<|START_OF_TURN_TOKEN|>",
            "<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
        ],
        [],
        {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"},
        None,
    ),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "abc123XYZ",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Weather in Paris?"}

#: The conversations agents send, in OpenAI's wire form: (name, messages, tools, template kwargs).
CONVERSATIONS = [
    ("user", [USER], None, {}),
    ("system", [SYSTEM, USER], None, {}),
    (
        "multi-turn",
        [SYSTEM, USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Tomorrow?"}],
        None,
        {},
    ),
    (
        "tool round trip",
        [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "content": "sunny"},
        ],
        [WEATHER],
        {},
    ),
    ("thinking off", [USER], None, {"enable_thinking": False}),
    ("thinking on", [USER], None, {"enable_thinking": True}),
]


def write_family(tiny_dir: str, out: Path, family: str) -> Path:
    special, plain, changes, _ = FAMILIES[family]
    return write_tokenizer_dir(tiny_dir, out, special, plain, changes, (REAL / f"{family}.jinja").read_text())


@pytest.fixture(scope="module")
def families(tiny_model_dir, tmp_path_factory):
    """Per family: (ChatFormat, transformers' tokenizer)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("real-templates")
    out = {}
    for family in FAMILIES:
        path = write_family(tiny_model_dir, root / family, family)
        out[family] = (ChatFormat.from_model_dir(path), AutoTokenizer.from_pretrained(str(path)))
    return out


def test_every_family_has_its_source_named():
    sources = (REAL / "SOURCES.md").read_text()
    for family in FAMILIES:
        assert (REAL / f"{family}.jinja").is_file() and family in sources


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_real_template_renders_what_agents_send_as_transformers_does(families, family):
    chat, tok = families[family]
    fmt = FAMILIES[family][3]
    as_object = fmt != "deepseek_v3"  # DeepSeek's template concatenates the arguments string
    compared = 0
    for name, wire, tools, kwargs in CONVERSATIONS:
        messages = [template_message(m, as_object) for m in wire]
        try:
            expected = list(
                tok.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    **kwargs,
                )
            )
        except Exception:  # the template refuses this conversation: so must we
            with pytest.raises(ChatTemplateError):
                chat.apply(messages, tools=tools, template_kwargs=kwargs)
            continue
        assert chat.apply(messages, tools=tools, template_kwargs=kwargs) == expected, (family, name)
        compared += 1
    assert compared >= 3, family  # most conversations render in every family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_tool_call_format_is_read_from_the_real_template(families, family):
    chat, _ = families[family]
    expected = FAMILIES[family][3]
    found = detect(chat.template_text)
    if expected is None:
        assert found is None or not chat.renders_tools, (family, found)
    else:
        assert found == expected, (family, found)


def test_templates_that_rewrite_history_are_named_with_what_they_change(families):
    """The warning preflight logs (`ChatFormat.rerenders`) names the real cause per family."""
    rewriting = {f: chat.rerenders for f, (chat, _) in families.items() if chat.rerenders}
    trimming = {"llama3.1", "llama3.2", "gemma3", "command-r"}  # whitespace around a reply goes
    assert set(rewriting) == {"qwen3", "deepseek-r1", "mistral-v0.3", "mistral-nemo", *trimming}
    for family in trimming:
        assert "a reply with whitespace around it differently" in rewriting[family]
    for family in ("mistral-v0.3", "mistral-nemo"):  # the system prompt moves, not the reply
        assert "moves the system prompt to the latest user turn" in rewriting[family]
    for family in ("qwen3", "deepseek-r1"):  # the earlier reply's <think> part changes
        assert "<think>" in rewriting[family] and "differently" in rewriting[family]


@pytest.mark.parametrize("family", ["mistral-v0.3", "granite3"])
def test_a_call_whose_marker_is_a_special_token_is_parsed(families, family, tiny_model_dir):
    """`[TOOL_CALLS]` and `<|tool_call|>` are special tokens: the content a reply shows drops
    them, so the endpoint parses the raw text (as vLLM's parsers keep special tokens there)."""
    import anyio
    import openai
    from test_openai_endpoint import ScriptedClient, _play

    from millstream.envpool.envs.agents.agent import AgentResult
    from millstream.shared.config import EnvPoolConfig

    chat, _ = families[family]
    marker = "[TOOL_CALLS]" if family.startswith("mistral") else "<|tool_call|>"
    reply = chat.encode(marker + '[{"name": "get_weather", "arguments": {"city": "Paris"}}]') + [chat.eos_id]
    seen = {}

    class Agent:
        async def run(self, seed, base_url, api_key):
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
                out = await c.chat.completions.create(model="m", messages=[USER], tools=[WEATHER])
                seen["message"] = out.choices[0].message
            return AgentResult(1.0)

    anyio.run(
        _play, chat, ScriptedClient([reply]), Agent(), EnvPoolConfig(max_tokens=200), 8192, backend="trio"
    )
    calls = seen["message"].tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert not seen["message"].content


#: The families that put a user turn's text verbatim between fixed text (their next prompt is
#: spliced, not rendered); Llama, Gemma and Command-R trim it, so theirs is rendered every time.
SPLICED = {
    "qwen2.5",
    "qwen3",
    "smollm2",
    "smollm3",
    "granite3",
    "phi3.5",
    "deepseek-r1",
    "mistral-v0.3",
    "mistral-nemo",
}

any_text = st.text(
    st.sampled_from("ab XY 01 .,:;'\"{}<>&\\/\n\t\u00e9\u4e2d\U0001f642"), max_size=40
) | st.sampled_from(["  padded  ", "\n", "<tool_response>\nx\n</tool_response>", "<|im_end|>", "[INST]"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_spliced_next_prompt_is_the_rendered_one(families, family):
    """Whatever the text (whitespace at its ends, markup, tags, special tokens), the next
    prompt's ids are those of a full render of the template, spliced or not."""
    chat, _ = families[family]

    def rendered(text: str, role: str) -> list[int]:
        return chat.encode(chat._after_reply(role, None, text)[len(chat.eos_text) :])

    @settings(max_examples=60, deadline=None)
    @given(any_text, st.sampled_from(["user", "tool"]))
    def check(text, role):
        try:
            expected = rendered(text, role)
        except ChatTemplateError:
            with pytest.raises(ChatTemplateError):
                chat.next_prompt(text, role=role)
            return
        assert chat.next_prompt(text, role=role) == expected

    check()
    splice = chat._verbatim("user")
    assert (splice is not None) == (family in SPLICED), family
    if splice is not None:  # the fixed text's ids are encoded once, on both sides of the content
        assert splice[0] and splice[3], family


# --- turn boundaries as a render tokenizes them -------------------------------------------------


def write_sentencepiece_family(out: Path, family: str) -> Path:
    """`family`'s template and special tokens on a small SentencePiece-style tokenizer (Metaspace,
    a space prefixed to the start of a text, as Llama 2, Mistral and Phi-3 tokenizers do)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    corpus = [
        "Hi there. Sure, again and again.\n",
        "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 \n\t.,!?<>|[]/_-",
    ]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=200, initial_alphabet=list("▁\n\t")))
    special, _plain, changes, _ = FAMILIES[family]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [*special, "<|endoftext|>"]]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **changes})
    )
    (out / "chat_template.jinja").write_text((REAL / f"{family}.jinja").read_text())
    return out


def rstrip_family(tiny_dir: str, out: Path, family: str) -> Path:
    """`family` on the tiny tokenizer, its special tokens stripping whitespace on their right."""
    path = write_family(tiny_dir, out, family)
    spec = json.loads((path / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["rstrip"] = token["content"] in FAMILIES[family][0]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize(
    "family, tokenizer",
    [(f, "sentencepiece") for f in ("phi3.5", "gemma3", "mistral-v0.3", "llama3.1", "qwen2.5")]
    + [("phi3.5", "rstrip")],
)
def test_the_next_turn_is_tokenized_behind_the_end_of_turn_token(tiny_model_dir, tmp_path, family, tokenizer):
    """The text after an end-of-turn token was encoded alone: a SentencePiece tokenizer then
    takes it for the start of a text and prefixes a space (`<|end|> ▁\\n <|user|>` where the
    render has `<|end|> \\n <|user|>`), and a token that strips the whitespace on its right left
    it in. Every turn of such a model's episodes started off the template, unseen."""
    from transformers import AutoTokenizer

    if tokenizer == "sentencepiece":
        path = write_sentencepiece_family(tmp_path / family, family)
    else:
        path = rstrip_family(tiny_model_dir, tmp_path / family, family)
    chat, hf = ChatFormat.from_model_dir(path), AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "Hi there"}]
    context = chat.first_prompt("", "Hi there")
    for reply, then in (("Sure.", "Again"), ("Sure, again.", "Hi")):
        messages.append({"role": "assistant", "content": reply})
        closed = list(hf.apply_chat_template(messages, return_dict=False))  # the reply as a render has it
        ids = closed[len(context) : closed.index(chat.eos_id, len(context)) + 1]
        context += ids + chat.close_turn(ids) + chat.next_prompt(then)
        messages.append({"role": "user", "content": then})
        expected = list(hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        assert context == expected, hf.convert_ids_to_tokens(context[-16:])


def test_a_reply_stopped_by_another_stop_token_is_closed_as_the_template_closes_it(families):
    """A base model's `<|endoftext|>` stops a reply without closing the turn; the template closes
    every assistant turn with the end-of-turn token, so it follows (untrained), and the context
    after it is the template's. It used to count as closed: `...Hello<|endoftext|>\\n<|im_start|>`."""
    chat, _ = families["qwen2.5"]
    other = chat.tokenizer.token_to_id("<|endoftext|>")
    assert other in chat.stop_token_ids and other != chat.eos_id
    assert chat.close_turn(chat.encode("Hello") + [other]) == [chat.eos_id]
    assert chat.close_turn(chat.encode("Hello") + [chat.eos_id]) == []
    assert chat.close_turn(chat.encode("Hello")) == [chat.eos_id]  # cut by length


def test_the_endpoint_splices_a_reply_where_the_template_closes_a_conversation_with_more(
    families, tiny_model_dir, tmp_path
):
    """Phi-3.5's template ends a conversation that ends with an assistant turn with its
    eos_token too (`<|end|>\\n<|endoftext|>`), which the next turn replaces: the splice asked the
    whole render to start with that, never spliced, and re-tokenized every earlier reply into
    a new segment. A reply sampled in pieces the tokenizer would not choose stays as sampled."""
    import openai
    from test_openai_endpoint import assert_recorded_as_sampled, play_scripted

    from millstream.envpool.envs.agents.agent import AgentResult

    path = write_family(tiny_model_dir, tmp_path / "phi3.5", "phi3.5")
    chat = families["phi3.5"][0]
    pieces = [t for ch in "Sunny." for t in chat.encode(ch)]  # not the tokenizer's own split
    assert pieces != chat.encode("Sunny.")
    replies = [
        pieces + [chat.eos_id],
        chat.encode("Rain.") + [chat.eos_id],
        chat.encode("Ok.") + [chat.eos_id],
    ]

    class Agent:
        async def run(self, seed, base_url, api_key):
            messages = [{"role": "user", "content": "Weather?"}]
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
                for question in ("Tomorrow?", "Thanks"):
                    out = await client.chat.completions.create(model="m", messages=messages)
                    messages += [
                        out.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": question},
                    ]
                await client.chat.completions.create(model="m", messages=messages)
            return AgentResult(1.0)

    traj, client, _ = play_scripted(path, Agent(), replies, max_tokens=50)
    assert traj.segment_starts == []  # one context, each call appended to it
    assert_recorded_as_sampled(traj, client)


def test_a_template_that_prints_the_date_is_rendered_afresh(families, monkeypatch):
    """Llama 3.2's template prints today's date in its first prompt: a cached prompt would keep
    the day it was made through a run that goes on past midnight."""
    import time

    from millstream.envpool.chat import templates

    chat, _ = families["llama3.2"]
    for day in ("28", "29"):  # the template's date and the cache's day move together
        monkeypatch.setitem(templates._ENV.globals, "strftime_now", lambda fmt, d=day: f"{d} Nov 2026")
        monkeypatch.setattr(time, "strftime", lambda fmt, d=day: f"2026-11-{d}")
        assert f"{day} Nov 2026" in chat.decode(chat.first_prompt("", "Hi"))
        assert chat.first_prompt("", "Hi") is not chat.first_prompt("", "Hi")  # copies of one cached
    assert len([k for k in chat._first if k[:2] == ("", "Hi")]) == 2  # one per day
    assert families["qwen2.5"][0]._dated is False  # a template without a date keeps its cache

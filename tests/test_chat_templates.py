"""The envpool's chat contexts equal transformers' `apply_chat_template`, token for token.

Four template families (tests/templates/, written for these tests) are applied to copies of the
tiny model's tokenizer with each family's special tokens added, and compared with
`AutoTokenizer.apply_chat_template(..., tokenize=True)` over generated conversations: the whole
conversation at once (`ChatFormat.apply`) and an episode's turn-by-turn append path
(`first_prompt`, then `close_turn` + `next_prompt` after each reply), where every reply is the
ids the template gives it (what a model that follows its template samples).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from millstream.envpool.chat import ChatFormat, ChatTemplateError

TEMPLATES = Path(__file__).parent / "templates"

# name: (where the template goes, added special tokens, added plain tokens, tokenizer_config.json changes)
FAMILIES = {
    "chatml_tools": ("config", [], ["<tool_call>", "</tool_call>"], {}),
    "llama3": (
        "file",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        [],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "gemma": (
        "list",
        ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        [],
        {"bos_token": "<bos>", "eos_token": "<eos>"},
    ),
    "thinking": ("config", [], ["<think>", "</think>"], {}),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city <today> & tomorrow.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None
)


def write_model_dir(tiny_dir: str, out: Path, family: str) -> Path:
    """A tokenizer directory: the tiny tokenizer plus the family's tokens, and its template."""
    where, special, plain, changes = FAMILIES[family]
    return write_tokenizer_dir(
        tiny_dir, out, special, plain, changes, (TEMPLATES / f"{family}.jinja").read_text(), where
    )


def write_tokenizer_dir(
    tiny_dir: str, out: Path, special: list, plain: list, changes: dict, template: str, where: str = "file"
) -> Path:
    """The tiny tokenizer plus `special` and `plain` added tokens, `changes` to its config, and
    `template` as its chat template (`where`: a file beside it, a named list, or the config)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.save(str(out / "tokenizer.json"))
    config = {**json.loads((Path(tiny_dir) / "tokenizer_config.json").read_text()), **changes}
    del config["chat_template"]
    if where == "file":
        (out / "chat_template.jinja").write_text(template)
    elif where == "list":
        config["chat_template"] = [{"name": "default", "template": template}]
    else:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def formats(tiny_model_dir, tmp_path_factory):
    """Per family: (ChatFormat, transformers' tokenizer, model dir)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("templates")
    out = {}
    for family in FAMILIES:
        path = write_model_dir(tiny_model_dir, root / family, family)
        out[family] = (ChatFormat.from_model_dir(path), AutoTokenizer.from_pretrained(str(path)), path)
    return out


def hf_ids(tok, messages, tools=None, add_generation_prompt=True) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
        )
    )


# Stripped text: a reply that starts with whitespace right after a generation prompt that ends
# with whitespace would merge with it in a fresh tokenization (a BPE boundary, not a template
# matter), and some templates trim contents.
texts = (
    st.text(st.sampled_from("abcdefgh ijklm XYZ 0123 .,?!:;'\"{}<>&\n\u00e9\u4e2d"), min_size=1, max_size=30)
    .map(str.strip)
    .filter(bool)
)


@st.composite
def conversations(draw, family: str):
    """(messages, tools, cut): system or not, tools or not, 1-4 rounds, each reply a text or
    (ChatML) tool calls answered by a tool result; `cut[k]` says reply k was cut by length."""
    tools = [WEATHER] if family == "chatml_tools" and draw(st.booleans()) else None
    messages = []
    if family != "gemma" and draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    messages.append({"role": "user", "content": draw(texts)})
    cut = []
    for _ in range(draw(st.integers(1, 4))):
        if family == "chatml_tools" and draw(st.booleans()):
            calls = [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": draw(texts)}}}
                for _ in range(draw(st.integers(1, 2)))
            ]
            content = draw(st.sampled_from(["", "Let me check."]))
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            messages.append({"role": "tool", "content": draw(texts)})
        else:
            messages.append({"role": "assistant", "content": draw(texts)})
            messages.append({"role": "user", "content": draw(texts)})
        cut.append(draw(st.booleans()))
    return messages, tools, cut


def play_turn_by_turn(chat: ChatFormat, tok, messages, tools, cut) -> list[list[int]]:
    """The episode's context before each reply, built by appending ids; each reply is the ids
    transformers gives that assistant message (less its end token when `cut`)."""
    has_system = messages[0]["role"] == "system"
    system = messages[0]["content"] if has_system else ""
    first = 2 if has_system else 1
    context = chat.first_prompt(system, messages[first - 1]["content"], tools=tools)
    contexts = [list(context)]
    for k, at in enumerate(range(first, len(messages), 2)):
        with_reply = hf_ids(tok, messages[: at + 1], tools, add_generation_prompt=False)
        assert with_reply[: len(context)] == context  # the template extends its own prompt
        end = with_reply.index(chat.eos_id, len(context))
        reply = with_reply[len(context) : end + (0 if cut[k] else 1)]
        observation = messages[at + 1]
        context += reply + chat.close_turn(reply)
        context += chat.next_prompt(observation["content"], role=observation["role"], tools=tools)
        contexts.append(list(context))
    return contexts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whole_conversations_equal_transformers(formats, family):
    chat, tok, _ = formats[family]

    @SETTINGS
    @given(conversations(family), st.booleans(), st.integers(1, 9))
    def check(conv, add_generation_prompt, length):
        messages, tools, _ = conv
        messages = messages[:length]
        assert chat.apply(messages, tools=tools, add_generation_prompt=add_generation_prompt) == hf_ids(
            tok, messages, tools, add_generation_prompt
        )

    check()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_turn_by_turn_contexts_equal_a_full_render_at_every_turn(formats, family):
    chat, tok, _ = formats[family]

    @SETTINGS
    @given(conversations(family))
    def check(conv):
        messages, tools, cut = conv
        contexts = play_turn_by_turn(chat, tok, messages, tools, cut)
        prompts_end = range(2 if messages[0]["role"] == "system" else 1, len(messages) + 1, 2)
        assert len(contexts) == len(prompts_end)
        for context, end in zip(contexts, prompts_end, strict=True):
            assert context == hf_ids(tok, messages[:end], tools)

    check()


def test_bos_is_rendered_and_counted_like_transformers(formats):
    chat, tok, _ = formats["llama3"]
    messages = [{"role": "user", "content": "Hello there."}]
    ids = chat.first_prompt("", "Hello there.")
    assert ids == hf_ids(tok, messages)
    bos = chat.tokenizer.token_to_id("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1
    # The same conversation with bos_token left out of the template's variables is one id
    # shorter: what the envpool rendered before it passed the special tokens.
    without_bos = ChatFormat(chat.tokenizer, (TEMPLATES / "llama3.jinja").read_text(), {})
    assert len(without_bos.first_prompt("", "Hello there.")) == len(ids) - 1


def test_end_of_turn_and_stop_tokens_come_from_the_template(formats):
    gemma, _, _ = formats["gemma"]
    assert gemma.tokenizer.id_to_token(gemma.eos_id) == "<end_of_turn>"
    eos = gemma.tokenizer.token_to_id("<eos>")
    assert {gemma.eos_id, eos} <= set(gemma.stop_token_ids)
    llama, _, _ = formats["llama3"]
    assert llama.tokenizer.id_to_token(llama.eos_id) == "<|eot_id|>"


def test_a_template_that_raises_names_itself_and_its_message(formats):
    chat, tok, _ = formats["gemma"]
    with pytest.raises(ChatTemplateError, match=r"'default' \(.*tokenizer_config.json\) raised: System role"):
        chat.first_prompt("Be brief.", "Hi.")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        chat.apply([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        hf_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}])


def test_template_file_beside_the_tokenizer_wins_over_the_config(formats, tmp_path):
    _, _, llama_dir = formats["llama3"]
    chat = ChatFormat.from_model_dir(llama_dir)
    assert chat.source.endswith("chat_template.jinja")
    copy = Path(shutil.copytree(llama_dir, tmp_path / "m"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('the config template must not be used') }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatFormat.from_model_dir(copy).first_prompt("", "Hi.") == chat.first_prompt("", "Hi.")


def test_named_templates_pick_tool_use_when_tools_are_given(formats, tmp_path):
    from transformers import AutoTokenizer

    _, _, chatml_dir = formats["chatml_tools"]
    copy = Path(shutil.copytree(chatml_dir, tmp_path / "m"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    plain += "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    config["chat_template"] = [
        {"name": "default", "template": plain},
        {"name": "tool_use", "template": config["chat_template"]},
    ]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    chat, tok = ChatFormat.from_model_dir(copy), AutoTokenizer.from_pretrained(str(copy))
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    assert chat.apply(messages) == hf_ids(tok, messages)
    assert chat.apply(messages, tools=[WEATHER]) == hf_ids(tok, messages, [WEATHER])
    assert chat.apply(messages, tools=[WEATHER]) != chat.apply(messages)
    assert "get_weather" in chat.decode(chat.first_prompt("", "Weather in Oslo?", tools=[WEATHER]))


def test_templates_that_rewrite_replies_are_reported_as_re_rendering(formats):
    """The thinking template drops earlier <think>; Llama 3's and Gemma's trim the whitespace
    around an earlier reply (a reply the model ended with a newline renders without it)."""
    assert {family: formats[family][0].rerenders is not None for family in FAMILIES} == {
        "chatml_tools": False,
        "llama3": True,
        "gemma": True,
        "thinking": True,
    }
    assert "<think>" in formats["thinking"][0].rerenders
    for family in ("llama3", "gemma"):
        assert "a reply with whitespace around it differently" in formats[family][0].rerenders


def test_a_re_rendering_template_keeps_the_sampled_tokens(formats):
    """Replies with <think>: the episode's context holds each reply exactly as sampled, while a
    fresh render of the same conversation drops the earlier thinking (what is trained is what
    the model saw)."""
    chat, tok, _ = formats["thinking"]
    replies = ["<think>\nTwo and two.\n</think>\n\nFour.", "<think>\nAdd one.\n</think>\n\nFive."]
    messages = [{"role": "user", "content": "2+2?"}]
    context = chat.first_prompt("", "2+2?")
    sampled = []
    for reply, question in zip(replies, ["And +1?", "Thanks."], strict=True):
        ids = chat.encode(reply) + [chat.eos_id]  # what the model sampled
        sampled.append((len(context), ids))
        context += ids + chat.close_turn(ids) + chat.next_prompt(question)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    for start, ids in sampled:
        assert context[start : start + len(ids)] == ids
    fresh = hf_ids(tok, messages)
    assert fresh != context
    stripped = chat.decode(context)
    for reply in replies:
        stripped = stripped.replace(reply, reply.split("</think>")[-1].lstrip("\n"))
    assert chat.decode(fresh) == stripped


def test_preflight_refuses_a_system_prompt_the_template_rejects(formats):
    from millstream.envpool.preflight import check_envpool
    from millstream.shared.config import load_config

    gemma_dir = formats["gemma"][2]
    problem = check_envpool(load_config(None, [f"model.path={gemma_dir}", "envpool.env=countdown"]))
    assert problem is not None and problem.startswith("model.path: chat template 'default'")
    assert (
        "System role not supported" in problem and "envpool.env = 'countdown', which has a system" in problem
    )
    assert check_envpool(load_config(None, [f"model.path={gemma_dir}", "envpool.env=evenchars"])) is None


def test_preflight_warns_about_a_re_rendering_template(formats, caplog):
    from millstream.envpool.preflight import check_envpool
    from millstream.shared.config import load_config

    for env in ("evenchars", "openai_agent"):  # an agent environment is warned too
        cfg = load_config(None, [f"model.path={formats['thinking'][2]}", f"envpool.env={env}"])
        caplog.clear()
        with caplog.at_level("WARNING", logger="envpool"):
            assert check_envpool(cfg) is None
        assert any("<think>" in r.getMessage() for r in caplog.records), env
    assert "new segment" in caplog.records[-1].getMessage()


def test_openai_shaped_tool_calls_render_as_transformers_renders_decoded_arguments(formats):
    """The endpoint gets `arguments` as a JSON string (the OpenAI wire); the template must see
    the object, as with transformers' documented convention, not a string quoted twice."""
    from millstream.envpool.agents.messages import template_message as _plain

    chat, tok, _ = formats["chatml_tools"]
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x y"}'}}
    wire = [
        {"role": "user", "content": "find x y"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "found"},
    ]
    decoded = [dict(m) for m in wire]
    decoded[1] = {
        **wire[1],
        "content": "",
        "tool_calls": [{**call, "function": {"name": "lookup", "arguments": {"q": "x y"}}}],
    }
    assert chat.apply([_plain(m) for m in wire]) == hf_ids(tok, decoded)
    assert '\\"' not in chat.decode(chat.apply([_plain(m) for m in wire]))

"""Token-in, token-out chat context: the envpool tokenizes, and only the environment's text.

Two ways to get prompt ids, both exactly what transformers'
`tokenizer.apply_chat_template(messages, tools=..., tokenize=True, add_generation_prompt=True)`
gives (tests/test_chat_templates.py compares them over generated conversations):

    chat = ChatFormat.from_model_dir(path)
    ids = chat.apply(messages, tools=tools)           # a whole conversation, rendered once

    ids = chat.first_prompt(system, observation)      # an episode, built by appending ids
    ...model generates `response` ids (ending with the end-of-turn token, or cut by length)...
    ids += response + chat.close_turn(response) + chat.next_prompt(observation)

An episode's context grows by *appending token ids*, never by re-rendering and re-tokenizing:
the tokens the model generated stay exactly as generated (BPE is not round-trip stable, so
decode-then-encode can change them, and the learner would then train on tokens the policy never
produced). `next_prompt` is the text a full render places after an assistant reply, cut from a
render of a probe conversation, so any template with a fixed turn structure works.

**Templates that re-render earlier turns.** Some render earlier turns differently as the
conversation goes on (Qwen3 and DeepSeek-R1 drop earlier `<think>` text, Mistral moves the system
prompt to the latest user turn): no append-only context can equal a fresh render then. The
envpool keeps appending (every turn's context is exactly the tokens the model saw, and that is
what the learner trains on); `ChatFormat` probes for it when it loads (`rerenders`, a sentence
naming what changes, or None), preflight logs it, and nothing fails mid-run.

This module uses `tokenizers` only (the templates' jinja is envpool/chat/templates.py): the
envpool never imports torch.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from millstream.envpool.chat.templates import (
    ChatTemplateError,
    compile_template,
    load_chat_templates,
    special_tokens,
)

__all__ = ["ChatFormat"]

_PROBE_SYSTEM, _PROBE_USER = "\x00system-probe\x00", "\x00user-probe\x00"
_PROBE_TOOL = "millstream_tool_probe"
_PROBE_ASSISTANT = "\x00assistant-probe\x00"
_PROBE_THINKING = "<think>\n\x00reasoning-probe\x00\n</think>\n\n\x00answer-probe\x00"
#: Texts a template might not render verbatim: surrounding whitespace (trimmed), markup and
#: quotes (escaped), tags some templates look for (tool responses, reasoning), special tokens,
#: jinja syntax, non-ASCII, nothing at all.
_VERBATIM_PROBES = (
    "",
    " ",
    "  both ends  ",
    "\n\nnewlines\n",
    "\ttab",
    "<tool_response>\nx\n</tool_response>",
    "<think>\nx\n</think>\n\ny",
    "<|im_end|><|eot_id|><end_of_turn></s>",
    "{{ x }}{% if %}",
    "&<>\"'\\",
    "\u00e9\u4e2d\U0001f642",
    "[TOOL_RESULTS] [INST]",
)


_Splice = tuple[list[int], str, str, list[int]]
"""A turn's content spliced: (ids before, text before, text after, ids after) it. The text
before opens with the added token it follows in a render, whose id is dropped once encoded
(`ChatFormat.encode_behind`)."""


class ChatFormat:
    """One model's chat template and tokenizer: whole-conversation ids and an episode's appends.

    `eos_id` is the token the template puts right after an assistant's reply (its end of turn:
    `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`); `stop_token_ids` adds the tokenizer's
    `eos_token` and generation_config.json's `eos_token_id`s. `rerenders` says why (a sentence)
    an append-only context differs from a fresh render for this template, or is None.
    """

    FIRST_PROMPT_CACHE = 1024

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: dict[str, str] | str,
        special_tokens: dict[str, str],
        *,
        stop_token_ids: tuple[int, ...] = (),
        source: str = "chat template",
    ) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens)
        self.source = source
        if isinstance(templates, str):
            templates = {"default": templates}
        #: Every template's source, one after another: what tool-call format they write is read
        #: from it (envpool/agents/toolformats.py `detect`).
        self.template_text = "\n".join(templates.values())
        self._templates: dict[str, jinja2.Template] = {}
        for name, text in templates.items():
            try:
                self._templates[name] = compile_template(text)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(
                    f"chat template {name!r} ({source}) does not compile: {exc}"
                ) from None
        specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # The end-of-turn token is whatever the template puts right after an assistant's text.
        after = self._after_reply("user", None, _PROBE_USER)
        first = self.encode(after)[:1]
        if not first or first[0] not in specials:
            raise ChatTemplateError(
                f"chat template ({source}) does not end an assistant turn with a special token "
                f"(it follows the reply with {after[:20]!r}): the end of a reply cannot be told apart"
            )
        self.eos_id = first[0]
        #: The end-of-turn token as text (what a render shows after an assistant's reply).
        self.eos_text: str = tokenizer.id_to_token(self.eos_id) or ""
        named = (special_tokens.get("eos_token"), "<|endoftext|>")
        self.stop_token_ids = sorted(
            {
                self.eos_id,
                *stop_token_ids,
                *(i for t in named if t and (i := tokenizer.token_to_id(t)) is not None),
            }
        )
        self.rerenders = self._probe_rerendering()
        #: Does the template show the model its tools? One that does not has no tool-call format
        #: of its own: the endpoint's (Hermes) is the only one the model ever sees.
        self.renders_tools = self._probe_renders_tools()
        # The members of a group share their first prompt; rendering a template is the
        # envpool's biggest CPU cost per episode after the transport, so cache it (bounded).
        self._first: OrderedDict[tuple[str, str, str], list[int]] = OrderedDict()
        # A template that prints today's date (Llama 3.2) keys its cache by the day too: a cached
        # prompt would keep the day it was made through a run that lasts past midnight.
        self._dated = "strftime_now" in self.template_text
        self._around: dict[str, _Splice | None] = {}  # `_verbatim`, by role
        #: The tokenizer's added tokens (special or not): it splits text at them first.
        self._added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatFormat:
        path = Path(path)
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        templates, source = load_chat_templates(path)
        stops: tuple[int, ...] = ()
        gen_config = path / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            stops = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        return cls(
            Tokenizer.from_file(str(path / "tokenizer.json")),
            templates,
            special_tokens(path, config),
            stop_token_ids=stops,
            source=source,
        )

    def _pick(self, tools: list[dict] | None) -> tuple[str, jinja2.Template]:
        """transformers' choice: `tool_use` when tools are given and it exists, else `default`."""
        if tools is not None and "tool_use" in self._templates:
            return "tool_use", self._templates["tool_use"]
        if "default" in self._templates:
            return "default", self._templates["default"]
        raise ChatTemplateError(
            f"{self.source} holds several chat templates, none named 'default': {sorted(self._templates)}"
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        *,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text for `messages`, as transformers renders it (tokenize=False).

        `template_kwargs` are extra variables of the template (`enable_thinking`, ...), as
        transformers passes `apply_chat_template`'s extra keyword arguments: over the special
        tokens, under the conversation's own names."""
        name, template = self._pick(tools)
        try:
            return template.render(
                **{**self.special_tokens, **(template_kwargs or {})},
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # the template's own error, with its message (raise_exception)
            what = "" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: "
            raise ChatTemplateError(f"chat template {name!r} ({self.source}) raised: {what}{exc}") from None

    def apply(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The ids of a whole conversation: `apply_chat_template(..., tokenize=True)` exactly.

        Messages may carry `tool_calls` (assistant) and role "tool", in whatever form the
        model's template reads them (most read `function.arguments` as a dict).
        """
        return self.encode(
            self.render(messages, add_generation_prompt, tools=tools, template_kwargs=template_kwargs)
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def first_prompt(self, system: str, observation: str, *, tools: list[dict] | None = None) -> list[int]:
        """The opening context: the system prompt (if any) and the first user turn."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": observation})
        if tools is not None:
            return self.apply(messages, tools=tools)
        key = (system, observation, time.strftime("%Y-%m-%d") if self._dated else "")
        ids = self._first.get(key)
        if ids is None:
            ids = self._first[key] = self.apply(messages)
            if len(self._first) > self.FIRST_PROMPT_CACHE:
                self._first.popitem(last=False)
        else:
            self._first.move_to_end(key)
        return list(ids)  # callers may extend it

    def close_turn(self, response_ids: list[int]) -> list[int]:
        """The end-of-turn token if the reply does not end with it; nothing otherwise.

        A reply lacks it when it was cut by length, or stopped by another stop token (a base
        model's `<|endoftext|>`), which stays in the context as sampled: the template closes an
        assistant turn with the end-of-turn token whatever ended the reply. It is not generated
        and carries no loss. The template's text after that token (ChatML: a newline) comes with
        `next_prompt`, encoded together with the next turn.
        """
        return [] if response_ids and response_ids[-1] == self.eos_id else [self.eos_id]

    def encode_behind(self, text: str, token: str | None = None) -> list[int]:
        """The ids of `text` where it follows the added token `token` (default: the end-of-turn
        token) in a render: encoded behind it, that token's id then dropped.

        Encoded alone it may come out otherwise: a SentencePiece tokenizer takes it for the
        start of a text and prefixes a space (`▁\n` where a render has `\n`), and a token that
        strips whitespace on its right would leave that whitespace in."""
        token = self.eos_text if token is None else token
        ids = self.encode(token + text)
        if not ids or ids[0] != self.tokenizer.token_to_id(token):
            raise ChatTemplateError(f"{token!r} does not encode as one token before {text[:20]!r}")
        return ids[1:]

    def next_prompt(
        self, observation: str, *, role: str = "user", tools: list[dict] | None = None
    ) -> list[int]:
        """Ids after a closed assistant turn: one more `role` turn and the generation prompt.

        Where the template puts a `role` turn's text verbatim between fixed text (`_verbatim`),
        that text is spliced in without rendering: a render per turn was a tenth of a worker's
        CPU. For every kind of text the probes try, the splice is the string the render gives;
        a template that branched on something else in the content (its length, a word no probe
        holds) would not be caught, which is why the probes hold what real templates test for
        (tests/test_real_templates.py compares splice and render on random text)."""
        splice = self._verbatim(role) if tools is None else None
        if splice is not None:
            head, before, after, tail = splice
            return head + self.encode(before + observation + after)[1:] + tail
        after = self._after_reply(role, tools, observation)
        if not after.startswith(self.eos_text):
            raise ChatTemplateError(
                f"chat template ({self.source}) ends an assistant turn before a {role!r} turn "
                f"differently ({after[:20]!r}) than before a user turn ({self.eos_text!r})"
            )
        return self.encode_behind(after[len(self.eos_text) :])

    def _verbatim(self, role: str) -> _Splice | None:
        """How to splice a `role` turn's content after a closed reply, when the template renders
        that content verbatim between fixed text; else None (it trims, escapes or branches on
        what the content says). Decided once per role by rendering probes of the kinds of text
        templates treat specially, each of which must come out exactly spliced."""
        if role in self._around:
            return self._around[role]
        splice: _Splice | None = None
        try:
            marked = self._after_reply(role, None, _PROBE_USER)
            before, _, after = marked.partition(_PROBE_USER)
            if marked.startswith(self.eos_text) and _PROBE_USER in marked:
                before = before[len(self.eos_text) :]
                rendered = (self._after_reply(role, None, t) for t in _VERBATIM_PROBES)
                if all(r == self.eos_text + before + t + after for r, t in zip(rendered, _VERBATIM_PROBES)):
                    splice = self._pieces(before, after)
        except ChatTemplateError:
            splice = None  # the slow path says what is wrong, each time
        self._around[role] = splice
        return splice

    def _pieces(self, before: str, after: str) -> _Splice:
        """The fixed text's ids encoded once, where special tokens bound them: a tokenizer splits
        at its added tokens before anything else, so the text up to the last one before the
        content, and from the first one after it, encodes the same alone. Only the stretch that
        holds the content is encoded per turn. Checked on the probes; if a tokenizer's tokens
        strip whitespace around them (or anything else joins across them), everything is
        encoded per turn instead."""
        lead, at = max(
            ((t, before.rfind(t)) for t in self._added if t in before),
            key=lambda found: found[1] + len(found[0]),
            default=(self.eos_text, -1),
        )
        cut_before = at + len(lead) if at >= 0 else 0
        cut_after = min((after.find(t) for t in self._added if t in after), default=len(after))
        head, rest_before = before[:cut_before], before[cut_before:]
        rest_after, tail = after[:cut_after], after[cut_after:]
        # Each stretch is encoded behind the added token it follows (`encode_behind`).
        pieces = (self.encode_behind(head), lead + rest_before, rest_after, self.encode(tail))
        for text in (*_VERBATIM_PROBES, _PROBE_USER):
            spliced = pieces[0] + self.encode(pieces[1] + text + rest_after)[1:] + pieces[3]
            if spliced != self.encode_behind(before + text + after):
                return [], self.eos_text + before, after, []
        return pieces

    def _after_reply(self, role: str, tools: list[dict] | None, observation: str) -> str:
        """The text a full render puts after an assistant's reply that a `role` turn follows."""
        messages = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
            {"role": role, "content": observation},
        ]
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        at = text.rfind(_PROBE_ASSISTANT)
        if at < 0:
            raise ChatTemplateError(
                f"chat template ({self.source}) does not render an assistant's reply verbatim"
            )
        return text[at + len(_PROBE_ASSISTANT) :]

    def _probe_renders_tools(self) -> bool:
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}}}
        try:
            text = self.render([{"role": "user", "content": _PROBE_USER}], True, tools=[tool])
        except ChatTemplateError:
            return True  # it reads tools in a way the probe does not satisfy: it has a format
        return _PROBE_TOOL in text

    def _probe_rerendering(self) -> str | None:
        """Why appending ids differs from a fresh render (a sentence), or None if it never does.

        Plays two rounds of a probe episode by appending, with and without a system turn, with
        a plain reply, one holding <think> and one with whitespace around it, and compares the
        text with a fresh render.
        """
        bridge = self._after_reply("user", None, _PROBE_USER)
        replies = (
            (_PROBE_ASSISTANT, "a plain reply"),
            (_PROBE_THINKING, "a reply with <think>"),
            (f" {_PROBE_ASSISTANT}\n", "a reply with whitespace around it"),  # Llama 3, Gemma trim
        )
        for reply, what in replies:
            for system in ([{"role": "system", "content": _PROBE_SYSTEM}], []):
                messages = [*system, {"role": "user", "content": _PROBE_USER}]
                try:
                    appended = self.render(messages, add_generation_prompt=True)
                except ChatTemplateError:
                    continue  # a template may refuse a system turn; that is checked per env
                for turn in range(2):
                    appended += reply + bridge
                    messages += [
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": _PROBE_USER},
                    ]
                    fresh = self.render(messages, add_generation_prompt=True)
                    if fresh != appended:
                        return (
                            f"the chat template ({self.source}) {_rewrite(appended, fresh, what)} once "
                            f"the conversation goes on (turn {turn + 2}); an episode keeps the tokens "
                            "the model saw, so its trained context differs from a fresh render"
                        )
        return None


def _rewrite(appended: str, fresh: str, what: str) -> str:
    """What a template changes in earlier turns, in words: the system prompt moving (Mistral's put
    it on the latest user turn), or the text of an earlier reply (where they first differ)."""
    if _PROBE_SYSTEM in appended and appended.find(_PROBE_SYSTEM) != fresh.find(_PROBE_SYSTEM):
        return "moves the system prompt to the latest user turn"
    at = next((i for i, (a, b) in enumerate(zip(appended, fresh)) if a != b), min(len(appended), len(fresh)))
    return f"renders {what} differently (appended {appended[at : at + 24]!r}, fresh {fresh[at : at + 24]!r})"

"""One sequence per episode: an assistant message the endpoint produced comes back as its tokens.

An agent sends its whole history with every call. Rendering that history afresh re-tokenizes the
model's earlier replies from their text (and, for tool calls, from the template's rendering of
the parsed call, which is rarely the text the model wrote), so the next prompt no longer extends
the tokens that were sampled: the record starts a new segment, and the learner trains the shared
prefix again in every segment, on tokens the model never produced.

So the endpoint remembers each reply it returned (`remember`: the message as the client got it,
the history and tools it answered, the prompt ids and the sampled ids). When a request's last
assistant message is one of them, sent back after the same history, `prompt` builds the ids as

    the reply's prompt ids + its sampled ids (+ the end-of-turn token unless it ended them)
    + the ids of the template's text after that token (the new messages, the generation
      prompt), encoded behind it as a render's tokenization has them

and the call extends the context token for token. Where the template itself rewrites history (a
render of the conversation up to the reply's end-of-turn token is not a prefix of the whole
render: Qwen3 and DeepSeek-R1 drop earlier `<think>` blocks), or the agent edited the message or
what came before it, `prompt` returns None and the endpoint renders afresh: a new segment, as
before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from millstream.envpool.chat import ChatFormat

__all__ = ["Splicer"]


@dataclass(frozen=True)
class _Produced:
    history: bytes
    prompt: list[int]
    reply: list[int]


class Splicer:
    """An episode's replies, by the message the client got; bounded by the episode's calls."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.produced: dict[bytes, _Produced] = {}

    def remember(
        self,
        messages: list[dict[str, Any]],
        context: tuple[Any, Any],
        prompt: list[int],
        reply: list[int],
        message: dict[str, Any],
    ) -> None:
        """The reply `message` was sampled as `reply` after `prompt`, answering `messages` with
        `context` (the request's tools and template arguments)."""
        self.produced[_message_key(message)] = _Produced(_history_key(messages, context), prompt, list(reply))

    def prompt(self, messages: list[dict[str, Any]], context: tuple[Any, Any]) -> list[int] | None:
        """The prompt ids with the last assistant message spliced in as sampled, or None."""
        k = next(
            (i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None
        )
        if k is None:
            return None
        hit = self.produced.get(_message_key(messages[k]))
        if hit is None or hit.history != _history_key(messages[:k], context):
            return None
        tools, kwargs = context

        def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self.chat.render(msgs, generation_prompt, tools=tools, template_kwargs=kwargs)

        try:
            before, upto, whole = (
                render(messages[:k], True),
                render(messages[: k + 1], False),
                render(messages, True),
            )
        except Exception:  # the endpoint's own render reports the template's error
            return None
        at = upto.rfind(self.chat.eos_text, len(before))
        if not upto.startswith(before) or at < 0:
            return None  # the template rewrites history here: render afresh
        # Up to the reply's end-of-turn token: a conversation that ends with the reply may be
        # closed by more (Phi-3.5 adds its eos_token there), which the next turn replaces.
        closed = at + len(self.chat.eos_text)
        if not whole.startswith(upto[:closed]):
            return None
        tail = whole[closed:]
        return hit.prompt + hit.reply + self.chat.close_turn(hit.reply) + self.chat.encode_behind(tail)


def _message_key(message: dict[str, Any]) -> bytes:
    """An assistant message as it identifies a reply: content (None and "" alike) and the tool
    calls' names and arguments (parsed, so re-serialized arguments still match)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {} if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                pass
        calls.append([function.get("name"), arguments])
    return orjson.dumps([message.get("content") or "", calls], option=orjson.OPT_SORT_KEYS)


def _history_key(messages: list[dict[str, Any]], context: tuple[Any, Any]) -> bytes:
    return orjson.dumps([messages, *context], option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)

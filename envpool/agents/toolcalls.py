"""Tool calls in generated text: Hermes/Qwen `<tool_call>` blocks -> OpenAI `tool_calls`.

Models of the Hermes and Qwen families write a function call as a JSON object between tags:

    <tool_call>
    {"name": "lookup", "arguments": {"word": "cat"}}
    </tool_call>

`parse_tool_calls(text)` finds every such block and returns the text outside them (the message's
`content`) and the calls in OpenAI's shape (`id`, `type`, `function.name`, `function.arguments`
as a JSON *string*). A block whose JSON is malformed, or that lacks a string `name`, is not a
call: it stays in the content, verbatim, and is counted in `malformed` (the caller reports it as
a format error). Nothing here raises on model output: the model writes what it writes.

The text parsed is the decoded generation; the tokens the model sampled are recorded as they are
(envpool/agents/endpoint.py), never re-tokenized from the parsed call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedReply", "parse_tool_calls", "tool_call_id"]

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


@dataclass
class ParsedReply:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    #: `<tool_call>` blocks that did not parse (left in `content`).
    malformed: int = 0


def tool_call_id(prefix: str, index: int) -> str:
    """A call id unique within the episode: the request's id and the call's index in it."""
    return f"call_{prefix}_{index}"


def _as_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already as a string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str, id_prefix: str = "0") -> ParsedReply:
    """Split generated text into content and tool calls (see the module docstring)."""
    if "<tool_call>" not in text:
        return ParsedReply(text)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    malformed = 0
    at = 0
    for match in _BLOCK.finditer(text):
        kept.append(text[at : match.start()])
        call = _as_call(match.group(1).strip())
        if call is None:
            malformed += 1
            kept.append(match.group(0))  # not a call: the model's text stays as it was
        else:
            name, arguments = call
            calls.append(
                {
                    "id": tool_call_id(id_prefix, len(calls)),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        at = match.end()
    kept.append(text[at:])
    return ParsedReply("".join(kept).strip() if calls else "".join(kept), calls, malformed)

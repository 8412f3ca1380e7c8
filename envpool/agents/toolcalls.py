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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["ForcedCall", "ParsedReply", "forced_call", "parse_reply", "parse_tool_calls", "tool_call_id"]

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


@dataclass(frozen=True)
class ForcedCall:
    """A reply that must be a tool call (`tool_choice` "required" or naming a function) starts
    with `opening`, given to the model as prompt tokens: the model writes the rest. For a named
    function with a string parameter, the opening ends inside that parameter's value
    (`argument`) and the model writes the value up to its closing quote: even a model that
    rarely calls tools writes a usable call."""

    opening: str
    name: str | None = None
    argument: str | None = None


def forced_call(tool_choice: str, function: str | None, tools: list[dict] | None) -> ForcedCall | None:
    """The opening of a forced call (Hermes/Qwen format), or None when the call is not forced."""
    if tool_choice not in ("required", "function"):
        return None
    head = '<tool_call>\n{"name": '
    if function is None:
        return ForcedCall(head + '"')
    tool = next(t for t in tools or () if (t.get("function") or {}).get("name") == function)
    props = (tool["function"].get("parameters") or {}).get("properties") or {}
    arg = next((k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"), None)
    head += orjson.dumps(function).decode() + ', "arguments": '
    if arg is None:
        return ForcedCall(head, function)
    return ForcedCall(head + "{" + orjson.dumps(arg).decode() + ': "', function, arg)


def parse_reply(
    text: str,
    tool_choice: str,
    forced: ForcedCall | None,
    parallel: bool,
    prefix: str,
    parser: Callable[[str, str], ParsedReply] = parse_tool_calls,
) -> ParsedReply:
    """A reply's content and tool calls as the request's `tool_choice` asks: "none" parses no
    call, a forced call is parsed with its opening (Hermes), `parallel` False keeps the first
    call; `parser` reads the model's own format (envpool/agents/toolformats.py)."""
    if tool_choice == "none":
        return ParsedReply(text)
    try:
        parsed = _parse(text, forced, prefix, parser)
    except Exception:  # model output never fails a call: it is a malformed call, counted
        return ParsedReply(text, [], 1)
    if not parallel and len(parsed.tool_calls) > 1:
        parsed.tool_calls = parsed.tool_calls[:1]  # at most one call, as OpenAI's flag means
    return parsed


def _parse(
    text: str, forced: ForcedCall | None, prefix: str, parser: Callable[[str, str], ParsedReply]
) -> ParsedReply:
    if forced is not None and forced.argument is None:  # the model wrote the rest of the call
        parsed = parse_tool_calls(forced.opening + text, prefix)
    elif forced is None:
        parsed = parser(text, prefix)
    else:  # the model wrote the value of the first string parameter, up to a quote
        arguments = orjson.dumps({forced.argument: _string_value(text)}).decode()
        call = {
            "id": tool_call_id(prefix, 0),
            "type": "function",
            "function": {"name": forced.name, "arguments": arguments},
        }
        parsed = ParsedReply("", [call])
    return parsed


def _string_value(text: str) -> str:
    """The JSON string the model wrote after an opening quote, up to its first unescaped quote,
    unescaped (`say \\"hi\\"` is `say "hi"`); the raw text where it is not valid JSON."""
    escaped, end = False, len(text)
    for i, ch in enumerate(text):
        if ch == '"' and not escaped:
            end = i
            break
        escaped = ch == "\\" and not escaped
    try:
        value = json.loads('"' + text[:end] + '"')
    except ValueError:
        return text[:end]
    return value if isinstance(value, str) else text[:end]

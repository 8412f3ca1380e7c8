"""Tool calls in each model family's own format, as vLLM's tool parsers name them.

A model writes a call the way its chat template taught it; the endpoint must read that format,
not one family's. `FORMATS` maps the names vLLM's `--tool-call-parser` uses to a parser from
generated text to `ParsedReply` (content and OpenAI `tool_calls`):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>     Qwen2.5, Hermes, SmolLM3
    qwen3_xml    <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>   Qwen3-Coder
    llama3_json  {"name": ..., "parameters": {...}} as the reply, after <|python_tag|> or not; `;` between
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}]  (v0.3) or [TOOL_CALLS]NAME[ARGS]{...}
    granite      <|tool_call|>[{"name": ..., "arguments": {...}}]
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json {...}``` ...
    pythonic     [name(a=1, b="x"), other()]                                   Llama-4, some small models

`detect(template_text)` picks one from the markers a template writes (a template with none of
them: hermes, the endpoint's default). What is not a well-formed call stays content and counts
as malformed; nothing here raises on model output.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from millstream.envpool.agents.toolcalls import ParsedReply, parse_tool_calls

__all__ = ["FORMATS", "SPECIAL_MARKERS", "detect", "parse", "call_id"]

#: Formats whose marker is a special token in the family's tokenizer, which a decode that skips
#: special tokens (what a reply's content shows) would remove: they are parsed from the raw text.
SPECIAL_MARKERS = frozenset({"mistral", "granite", "deepseek_v3", "llama3_json"})


def call_id(prefix: str, index: int, fmt: str = "hermes") -> str:
    """A call id unique within the episode. Mistral's templates accept only 9 alphanumerics."""
    if fmt == "mistral":
        return hashlib.sha1(f"{prefix}_{index}".encode()).hexdigest()[:9]
    return f"call_{prefix}_{index}"


def _call(name: Any, arguments: Any, prefix: str, index: int, fmt: str) -> dict[str, Any] | None:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {
        "id": call_id(prefix, index, fmt),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _json_objects(text: str) -> list[Any] | None:
    """JSON values one after another, separated by whitespace or `;`; None if any is not."""
    decoder, at = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return out
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        out.append(value)


def _from_objects(objects: list[Any], prefix: str, fmt: str, key: str = "arguments") -> list[dict] | None:
    calls: list[dict] = []
    for obj in objects:
        if not isinstance(obj, dict):
            return None
        call = _call(
            obj.get("name"),
            obj.get(key, obj.get("arguments", obj.get("parameters"))),
            prefix,
            len(calls),
            fmt,
        )
        if call is None:
            return None
        calls.append(call)
    return calls


def _parse_llama3_json(text: str, prefix: str) -> ParsedReply:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedReply(text)
    objects = _json_objects(body)
    calls = _from_objects(objects, prefix, "llama3_json", "parameters") if objects else None
    return ParsedReply("", calls) if calls else ParsedReply(text, [], 1)


def _parse_mistral(text: str, prefix: str) -> ParsedReply:
    if "[TOOL_CALLS]" not in text:
        return ParsedReply(text)
    content, _, rest = text.partition("[TOOL_CALLS]")
    rest = rest.strip()
    calls: list[dict] | None
    if rest.startswith("["):  # v0.3: a JSON list of calls
        objects = _json_objects(rest)
        calls = (
            _from_objects(objects[0], prefix, "mistral") if objects and isinstance(objects[0], list) else None
        )
    else:  # newer tokenizers: NAME[ARGS]{...}, repeated after further [TOOL_CALLS]
        calls = []
        for part in rest.split("[TOOL_CALLS]"):
            name, sep, arguments = part.partition("[ARGS]")
            call = _call(name.strip(), arguments.strip(), prefix, len(calls), "mistral") if sep else None
            if call is None:
                calls = None
                break
            calls.append(call)
    return ParsedReply(content.strip(), calls) if calls else ParsedReply(text, [], 1)


def _parse_granite(text: str, prefix: str) -> ParsedReply:
    if "<|tool_call|>" not in text:
        return ParsedReply(text)
    content, _, rest = text.partition("<|tool_call|>")
    objects = _json_objects(rest.strip())
    calls = _from_objects(objects[0], prefix, "granite") if objects and isinstance(objects[0], list) else None
    return ParsedReply(content.strip(), calls) if calls else ParsedReply(text, [], 1)


_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<name>[^\n<]+?)\s*"
    r"(?:<｜tool▁sep｜>)?\s*(?:```json)?\s*(?P<args>\{.*?\})\s*(?:```)?\s*<｜tool▁call▁end｜>",
    re.S,
)


def _parse_deepseek_v3(text: str, prefix: str) -> ParsedReply:
    if "<｜tool▁calls▁begin｜>" not in text:
        return ParsedReply(text)
    content, _, rest = text.partition("<｜tool▁calls▁begin｜>")
    calls: list[dict] = []
    for match in _DEEPSEEK_CALL.finditer(rest):
        call = _call(match.group("name").strip(), match.group("args"), prefix, len(calls), "deepseek_v3")
        if call is None:
            return ParsedReply(text, [], 1)
        calls.append(call)
    return ParsedReply(content.strip(), calls) if calls else ParsedReply(text, [], 1)


_QWEN3_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
_QWEN3_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _parse_qwen3_xml(text: str, prefix: str) -> ParsedReply:
    if "<function=" not in text:
        return parse_tool_calls(text, prefix)  # a Hermes-style block: Qwen3's other format
    calls: list[dict] = []
    kept, at = [], 0
    for match in _QWEN3_BLOCK.finditer(text):
        kept.append(text[at : match.start()])
        arguments: dict[str, Any] = {}
        for name, value in _QWEN3_PARAM.findall(match.group(2)):
            try:
                arguments[name] = json.loads(value)
            except ValueError:
                arguments[name] = value  # a string parameter is written bare
        call = _call(match.group(1), arguments, prefix, len(calls), "qwen3_xml")
        if call is not None:
            calls.append(call)
        at = match.end()
    kept.append(text[at:])
    return ParsedReply("".join(kept).strip(), calls) if calls else ParsedReply(text, [], 1)


def _parse_pythonic(text: str, prefix: str) -> ParsedReply:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return ParsedReply(text)
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        calls: list[dict] = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("not a call with keyword arguments")
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            call = _call(node.func.id, arguments, prefix, len(calls), "pythonic")
            if call is None:
                raise ValueError("bad call")
            calls.append(call)
    except (SyntaxError, ValueError, RecursionError):
        return ParsedReply(text, [], 1)
    return ParsedReply("", calls)


#: vLLM's parser names -> the parser of that format.
FORMATS: dict[str, Callable[[str, str], ParsedReply]] = {
    "hermes": parse_tool_calls,
    "qwen3_xml": _parse_qwen3_xml,
    "llama3_json": _parse_llama3_json,
    "mistral": _parse_mistral,
    "granite": _parse_granite,
    "deepseek_v3": _parse_deepseek_v3,
    "pythonic": _parse_pythonic,
}

#: The marker a template writes for each format, checked in this order (Qwen3-Coder's template
#: also writes <tool_call>, so its <function= comes first).
_MARKERS = (
    ("<function=", "qwen3_xml"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('{"name": function name, "parameters"', "llama3_json"),  # Llama 3.2 writes no python_tag
    ("<|tool_call|>", "granite"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<|python_start|>", "pythonic"),
)


def detect(template_text: str) -> str | None:
    """The tool-call format a chat template writes, or None if it shows no known marker."""
    return next((fmt for marker, fmt in _MARKERS if marker in template_text), None)


def parse(text: str, fmt: str, prefix: str) -> ParsedReply:
    """`text`'s content and tool calls, read in format `fmt` (a key of `FORMATS`)."""
    return FORMATS[fmt](text, prefix)

"""Messages as chat templates take them, from messages as OpenAI clients send them.

OpenAI allows `content` to be None or a list of text parts, sends a call's `arguments` as a JSON
string and names the system role `developer` in newer clients; templates expect a string, most
read the arguments as an object (DeepSeek's the string), and know only `system`.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["template_message"]


def template_message(message: dict[str, Any], arguments_as_object: bool = True) -> dict[str, Any]:
    """A message as chat templates expect it: content a string (OpenAI allows None and text
    parts), tool-call arguments an object, and OpenAI's `developer` role (its newer name for
    `system`, the instructions a model follows first) as `system`, the only one templates know."""
    content = message.get("content")
    if isinstance(content, list):  # text parts, joined as vLLM joins them
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    plain = {**message, "content": content or ""}
    if message.get("role") == "developer":
        plain["role"] = "system"
    if message.get("tool_calls") and arguments_as_object:
        plain["tool_calls"] = [_call_with_dict_arguments(c) for c in message["tool_calls"]]
    return plain


def _call_with_dict_arguments(call: Any) -> Any:
    """OpenAI sends a call's `arguments` as a JSON string; chat templates (Qwen's, Hermes')
    render them with `tojson`, as transformers documents, so they take the decoded object (a
    string would come out quoted twice). Arguments that are not a JSON object stay as sent."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = orjson.loads(function["arguments"])
    except orjson.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}

"""What a generation becomes in an OpenAI response: stop strings, logprobs, envelopes, streams.

The actor works in token ids and knows no text, so a request's stop *strings* are applied here,
after the generation: `cut_at_stop` keeps the fewest tokens whose text holds a stop string (the
same first-completed-stop rule as vLLM's incremental check), and the returned text ends before
it (or after it, with `include_stop_str_in_output`). What is recorded for training is that token
prefix: a prefix of a sampled sequence, stopped by a rule that reads only that prefix, is itself
a sample of the policy. The tokens the engine generated past the stop are discarded, which costs
engine time (the actor could stop early if it detokenized; it does not, on purpose).

The response shapes follow vLLM's server: `logprobs.content` (chat) or `tokens` /
`token_logprobs` (completions) for the sampled tokens, `stop_reason` naming the stop string,
`prompt_token_ids` / `token_ids` with `return_token_ids`, and the chunks of a stream, a few per
choice (the actor path returns a call at once, so there is nothing finer to stream). The HTTP
part (starlette) stays in envpool/agents/endpoint.py: this module needs only the core packages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from millstream.envpool.actors.generation import Generation
from millstream.envpool.chat import ChatFormat

__all__ = [
    "MODEL_NAME",
    "Reply",
    "cut_at_stop",
    "envelope",
    "usage",
    "chat_chunks",
    "logprobs_of",
    "raw_text",
]

#: What `GET /v1/models` lists; requests may name any model (there is one policy).
MODEL_NAME = "millstream-policy"


@dataclass
class Reply:
    """One sampled choice: the tokens kept (what is recorded), its text, why it ended."""

    gen: Generation
    text: str
    finish_reason: str
    #: The stop string that ended it (vLLM's `stop_reason`), or None.
    stop_reason: str | None = None


def cut_at_stop(chat: ChatFormat, gen: Generation, stops: tuple[str, ...], include: bool) -> Reply:
    """The reply `gen` makes with the request's stop strings applied (module docstring)."""
    text = chat.decode(gen.token_ids)
    finish = "length" if gen.finish_reason == "length" else "stop"
    if not stops or not any(s in text for s in stops):
        return Reply(gen, text, finish)
    lo, hi = 1, len(gen.token_ids)  # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in chat.decode(gen.token_ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = chat.decode(gen.token_ids[:lo])
    at, stop = min((text.find(s), s) for s in stops if s in text)
    kept = Generation(
        gen.token_ids[:lo],
        gen.logprobs[:lo],
        gen.versions[:lo],
        "stop",
        gen.top_logprobs[:lo],
        request_id=gen.request_id,
    )
    shown = text[: at + len(stop)] if include else text[:at]
    return Reply(kept, shown, "stop", stop)


def raw_text(chat: ChatFormat, ids: list[int]) -> str:
    """The text with special tokens kept (the stop tokens left out): where a family's tool-call
    marker is a special token (`[TOOL_CALLS]`, `<|tool_call|>`), only this text shows it. Decoded
    only for those families' replies (`toolformats.SPECIAL_MARKERS`)."""
    return chat.tokenizer.decode([t for t in ids if t not in chat.stop_token_ids], skip_special_tokens=False)


def logprobs_of(chat: ChatFormat, gen: Generation, *, chat_shape: bool) -> dict[str, Any]:
    """The sampled tokens' logprobs (and the most likely tokens', when asked), in the chat or
    the completions shape."""

    def text(token: int) -> str:
        return chat.tokenizer.decode([token], skip_special_tokens=False)

    tokens = [text(t) for t in gen.token_ids]
    tops = gen.top_logprobs or [[] for _ in tokens]
    if chat_shape:
        content = [
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in top
                ],
            }
            for tok, lp, top in zip(tokens, gen.logprobs, tops, strict=True)
        ]
        return {"content": content}
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": list(gen.logprobs),
        "top_logprobs": [{text(t): v for t, v in top} for top in tops] if gen.top_logprobs else None,
        "text_offset": offsets,
    }


def usage(prompt: list[int], replies: list[Reply]) -> dict[str, int]:
    n = sum(len(r.gen.token_ids) for r in replies)
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def envelope(ident: str, obj: str, choices: list, use: dict | None, **extra: Any) -> dict[str, Any]:
    out = {"id": ident, "object": obj, "created": int(time.time()), "model": MODEL_NAME, "choices": choices}
    if use is not None:
        out["usage"] = use
    out.update(extra)
    return out


def chat_chunks(ident: str, choices: list[dict], use: dict, include_usage: bool) -> Iterator[dict]:
    """Each whole choice as a stream: a role delta, its content, its tool calls, its finish."""

    def chunk(index: int, delta: dict, reason: str | None = None, **more: Any) -> dict:
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None, **more}
        return envelope(ident, "chat.completion.chunk", [choice], None)

    for c in choices:
        i, message = c["index"], c["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        if message["content"]:
            yield chunk(i, {"content": message["content"]}, logprobs=c["logprobs"])
        for k, call in enumerate(message.get("tool_calls", [])):
            yield chunk(i, {"tool_calls": [{"index": k, **call}]})
        yield chunk(i, {}, c["finish_reason"], stop_reason=c.get("stop_reason"))
    if include_usage:
        yield {**envelope(ident, "chat.completion.chunk", [], None), "usage": use}

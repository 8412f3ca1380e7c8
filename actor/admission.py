"""What an actor serves and what it refuses, shared by every actor kind (vLLM and synthetic).

Requests are judged as they are read (actor/boundary.py), before any work starts, so a refusal
costs the actor almost nothing and names the request. There are two kinds of refusal, because the
envpool treats them differently:

- `bad_request`: the request itself is wrong (an empty prompt, a budget past `max_model_len`, a
  token id outside the vocabulary, sampling parameters vLLM would refuse). Retrying cannot help,
  so the envpool never retries it; the episode fails.
- `overloaded`: more than `actor.max_live_requests` requests are held. It says "try later": the
  envpool retries with backoff (or another replica), and the actor's memory stays bounded
  whatever the clients do.

A message an actor does not take at all is answered with an `ErrorReply` (`unexpected`).
"""

from __future__ import annotations

from millstream.shared.wire import ErrorReply, GenerateError, GenerateRequest, Message, ReplyCause, TurnError

__all__ = ["MAX_TEMPERATURE", "check_request", "refusal", "unexpected"]

#: vLLM refuses temperatures outside [0, 2]; checked here so the refusal names the request.
MAX_TEMPERATURE = 2.0
#: The most `top_logprobs` a request may ask for (vLLM's engine default `max_logprobs`).
MAX_TOP_LOGPROBS = 20


def check_request(req: GenerateRequest, max_model_len: int, vocab_size: int) -> str | None:
    """What is wrong with a request, in words, or None. Shared by every actor kind."""
    if not req.prompt_token_ids:
        return "empty prompt"
    if req.max_tokens < 1:
        return f"max_tokens must be >= 1, got {req.max_tokens}"
    if not 0 <= req.min_tokens <= req.max_tokens:
        return f"min_tokens must be in [0, max_tokens={req.max_tokens}], got {req.min_tokens}"
    total = len(req.prompt_token_ids) + req.max_tokens
    if total > max_model_len:
        return (
            f"prompt ({len(req.prompt_token_ids)}) + max_tokens ({req.max_tokens}) = "
            f"{total} exceeds max_model_len {max_model_len}"
        )
    for what, ids in (("prompt", req.prompt_token_ids), ("stop", req.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"{what} token id {bad} outside the vocabulary [0, {vocab_size})"
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}"
    if not 0 <= req.temperature <= MAX_TEMPERATURE or not 0 < req.top_p <= 1:
        return (
            f"bad sampling parameters temperature={req.temperature} (expected [0, "
            f"{MAX_TEMPERATURE}]) top_p={req.top_p} (expected (0, 1])"
        )
    return None


def refusal(
    req: GenerateRequest, live: int, max_live: int, max_model_len: int, vocab_size: int
) -> GenerateError | None:
    """The error that refuses `req`, or None to serve it. Shared by every actor kind.

    `overloaded` (more than `actor.max_live_requests` held) says "try later" and the envpool
    retries it; `bad_request` says the request itself is wrong and is never retried.
    """
    problem = check_request(req, max_model_len, vocab_size)
    if problem is not None:
        return GenerateError(req.request_id, TurnError.BAD_REQUEST, problem)
    if live >= max_live:
        return GenerateError(
            req.request_id,
            TurnError.OVERLOADED,
            f"{live} requests live, the limit (actor.max_live_requests) is {max_live}",
        )
    return None


def unexpected(message: Message) -> ErrorReply:
    """The answer to a message an actor does not take."""
    return ErrorReply(ReplyCause.UNEXPECTED_MESSAGE, f"the actor does not take {type(message).__name__}")

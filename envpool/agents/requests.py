"""What an agent's request asks for, checked field by field before anything is generated.

An agent written against `vllm serve` sends whatever its framework sends. A field the endpoint
accepted and then ignored would answer with a 200 and do something else than asked (a stop
string that does not stop, a seed that does not repeat): the worst kind of mismatch, because
nothing says so. So every field of `/v1/chat/completions` and `/v1/completions` is in one of
three tables here:

- **honoured** (`_CHAT_FIELDS`, `_COMPLETION_FIELDS`): parsed into `ChatRequest` /
  `CompletionRequest` and done as vLLM's server does it;
- **neutral only** (`_NEUTRAL`): sampling controls the learner does not model (penalties,
  logit bias, top-k, guided decoding...). Their neutral value (absent, null, or what changes
  nothing, such as `frequency_penalty: 0`) is accepted; any other value is a 400 naming the
  field, since the trained policy would not be the one that sampled;
- **metadata** (`_METADATA`): names and tags that change no output (`model`, `user`, ...).

Anything else is a 400 that names the unknown fields (a typo such as `max_token` is caught, not
dropped). `temperature` and `top_p` are the run's (`envpool.temperature`, `top_p`): the learner
recomputes logprobs at those, so a request may send them only at the run's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from millstream.envpool.agents.messages import template_message

__all__ = [
    "ApiError",
    "CallOptions",
    "ChatRequest",
    "CompletionRequest",
    "RunSampling",
    "parse_chat",
    "parse_completion",
]

#: The most stop strings one request may name (OpenAI allows 4; vLLM more).
MAX_STOP_STRINGS = 16
#: The most `top_logprobs` (the actor's limit, actor/admission.py).
MAX_TOP_LOGPROBS = 20
#: The most samples of one prompt (`n`); each also counts against `envpool.max_turns`.
MAX_N = 16


class ApiError(Exception):
    """A request the endpoint answers with an OpenAI-style error body and this status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class RunSampling:
    """The run's sampling (`[envpool]`), which a request may narrow (`max_tokens`) but not change."""

    max_tokens: int
    temperature: float
    top_p: float
    #: False: a request's own temperature/top_p are replaced by these instead of refused.
    strict: bool = True


@dataclass(frozen=True)
class CallOptions:
    """What both routes share: how much to generate, where to stop, what to return."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    #: The request's own seed: the same seed in the same episode samples the same reply.
    seed: int | None = None
    #: Return the sampled tokens' logprobs (chat: `logprobs: true`; completions: `logprobs: k`)
    #: and, per token, the `top_logprobs` most likely tokens (from the actor, as vLLM does).
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    #: vLLM's `return_token_ids`: the prompt's and each choice's token ids in the response.
    return_token_ids: bool = False


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    #: "auto", "none", "required", or the name of the function a call must use.
    tool_choice: str
    forced_function: str | None
    parallel_tool_calls: bool
    template_kwargs: dict[str, Any]
    options: CallOptions


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    echo: bool
    options: CallOptions


#: Fields that change no output.
_METADATA = frozenset({"model", "user", "metadata", "store", "service_tier", "request_id", "priority"})

#: Sampling controls the learner does not model, with the values that leave sampling as it is.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "logit_bias": ({},),
    "top_k": (-1, 0),
    "min_p": (0,),
    "min_tokens": (0,),
    "best_of": (1,),
    "use_beam_search": (False,),
    "ignore_eos": (False,),
    "response_format": ({"type": "text"},),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "stop_token_ids": ([],),
    "prompt_logprobs": (0,),
    "truncate_prompt_tokens": (),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "add_special_tokens": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "suffix": ("",),
    "reasoning_effort": (),
    "chat_template": (),
    "documents": (),
    "functions": (),
    "function_call": (),
}

_SHARED_FIELDS = frozenset(
    {
        "max_tokens",
        "stop",
        "include_stop_str_in_output",
        "seed",
        "n",
        "stream",
        "stream_options",
        "return_token_ids",
        "temperature",
        "top_p",
    }
)
_CHAT_FIELDS = _SHARED_FIELDS | {
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
}
_COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt", "echo", "logprobs"}


def parse_chat(body: dict[str, Any], run: RunSampling, *, arguments_as_object: bool = True) -> ChatRequest:
    """A `/chat/completions` body as a `ChatRequest`, or an `ApiError` naming what is wrong.
    `arguments_as_object`: the template reads a call's arguments as an object (most do), not as
    the JSON string OpenAI sends (DeepSeek's)."""
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of objects", param="messages")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
        raise ApiError(
            400, 'tools must be a list of {"type": "function", "function": {"name": ...}}', param="tools"
        )
    for m in messages:
        _check_message(m)
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    top = _count(body, "top_logprobs", MAX_TOP_LOGPROBS)
    if top and not body.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "documents"})
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
    parallel = body.get("parallel_tool_calls")
    return ChatRequest(
        messages=[template_message(m, arguments_as_object) for m in messages],
        tools=tools,
        tool_choice=choice,
        forced_function=forced,
        parallel_tool_calls=parallel is not False,
        template_kwargs=kwargs,
        options=_options(
            body,
            (_flag(body, "logprobs"), top),
            _first_set(body, "max_completion_tokens", "max_tokens"),
            run,
        ),
    )


def parse_completion(body: dict[str, Any], run: RunSampling) -> CompletionRequest:
    """A `/completions` body as a `CompletionRequest`, or an `ApiError` naming what is wrong."""
    _check_fields(body, _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        prompt = list(prompt)  # token ids: token in, as is
    elif not (isinstance(prompt, str) and prompt):
        raise ApiError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
    logprobs = _count(body, "logprobs", MAX_TOP_LOGPROBS) if body.get("logprobs") is not None else None
    if logprobs is not None and body.get("echo"):
        raise ApiError(400, "echo with logprobs: the prompt's logprobs are not computed here", param="echo")
    return CompletionRequest(
        prompt=prompt,
        echo=_flag(body, "echo"),
        options=_options(
            body,
            (logprobs is not None, logprobs or 0),
            body.get("max_tokens"),
            run,
        ),
    )


# --- the parts -------------------------------------------------------------------------------


def _check_fields(body: dict[str, Any], honoured: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in honoured and k not in _NEUTRAL and k not in _METADATA)
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise ApiError(
                400,
                f"{name}={value!r} is not supported: it changes how tokens are sampled, and the learner "
                "trains on the run's sampling policy (omit it, or send its neutral value"
                + (f" {neutral[0]!r})" if neutral else ")"),
                param=name,
            )


def _same(value: Any, neutral: Any) -> bool:
    """`value == neutral`, but a boolean is not a number (`False` is not `frequency_penalty: 0`)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _count(body: dict[str, Any], name: str, most: int) -> int:
    value = body.get(name)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ApiError(400, f"{name} must be an integer from 0 to {most}, got {value!r}", param=name)
    return value


def _options(body: dict[str, Any], logprobs: tuple[bool, int], asked: Any, run: RunSampling) -> CallOptions:
    for name, run_value, key in (
        ("temperature", run.temperature, "envpool.temperature"),
        ("top_p", run.top_p, "envpool.top_p"),
    ):
        value = body.get(name)
        if (
            value is not None
            and run.strict
            and (not isinstance(value, (int, float)) or float(value) != run_value)
        ):
            raise ApiError(
                400,
                f"{name}={value!r}: this endpoint samples at the run's {key}={run_value} (the learner "
                f"trains on that policy); omit {name} or send {run_value}",
                param=name,
            )
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise ApiError(400, f"max_tokens must be a positive integer, got {asked!r}", param="max_tokens")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError(400, f"seed must be an integer, got {seed!r}", param="seed")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer from 1 to {MAX_N}, got {n!r}", param="n")
    if n > 1 and run.temperature == 0:  # as vLLM: n greedy samples would be n copies
        raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}", param="n")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return CallOptions(
        max_tokens=min(asked or run.max_tokens, run.max_tokens),
        stop=_stop(body.get("stop")),
        include_stop=_flag(body, "include_stop_str_in_output"),
        seed=seed,
        logprobs=logprobs[0],
        top_logprobs=logprobs[1],
        n=n,
        stream=_flag(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
        return_token_ids=_flag(body, "return_token_ids"),
    )


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop names {len(stops)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    return tuple(s for s in stops if s)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", param=name)
    return bool(value)


def _tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """(mode, forced function name). OpenAI's default: "auto" with tools, "none" without."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ApiError(400, 'tool_choice "required" needs tools', param="tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        name = choice["function"]["name"]
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return "function", name
    raise ApiError(
        400,
        f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
        f'{{"name": ...}}}}, got {choice!r}',
        param="tool_choice",
    )


def _is_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return False
    parameters = function.get("parameters")
    if parameters is None:
        return True
    return isinstance(parameters, dict) and isinstance(parameters.get("properties", {}), dict)


def _check_message(message: dict[str, Any]) -> None:
    """A message the template can take: text content parts only, tool calls naming a function."""
    content = message.get("content")
    if isinstance(content, list) and any(
        not isinstance(p, dict) or p.get("type", "text") != "text" for p in content
    ):
        raise ApiError(400, "only text content parts are supported (the model reads text)", param="messages")
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(_names_a_function(c) for c in calls)):
        raise ApiError(
            400,
            'tool_calls must be a list of {"function": {"name": ..., "arguments": ...}}',
            param="messages",
        )


def _names_a_function(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _first_set(body: dict[str, Any], *names: str) -> Any:
    """The first of `names` that the body sets to something other than null (vLLM's `or`)."""
    return next((body[n] for n in names if body.get(n) is not None), None)

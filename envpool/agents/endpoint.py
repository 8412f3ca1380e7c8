"""An OpenAI-compatible endpoint per episode, served by the envpool worker on its own event loop.

An agent environment (envpool/agents/episode.py) gets, per episode,

    base_url = http://127.0.0.1:PORT/episodes/<episode_id>/v1    api_key = <random, per episode>

and talks to it with the official `openai` client (or anything that speaks the API):
`POST chat/completions` (streamed or not, `tools` and `tool_calls`, `n=1`), `POST completions`
(a text prompt or a list of token ids), `GET models`. It is a starlette app served by hypercorn
on the worker's trio loop, bound to loopback only; an unknown or finished episode gets a 404 and a
wrong key a 401, each with an OpenAI-style error body.

What a call does: the messages are rendered with the model's chat template (`ChatFormat.apply`,
the envpool owns tokenization), the ids go through the worker's normal actor path (the episode's
`TurnClient` with its affinity and a seed derived from the group seed, member and call number),
and the generated text is returned, `<tool_call>` blocks parsed into `tool_calls`
(envpool/agents/toolcalls.py). Every call's prompt ids, generated ids, logprobs and policy versions are
recorded into the episode (`EpisodeRecord`).

What is trained: the generated tokens only (prompt tokens carry no loss). A call whose prompt
extends the previous context token for token (previous prompt + previous generation + what the
template adds) is appended to it; a call whose prompt does not (the template re-rendered the
model's reply differently, or the agent edited its history) starts a new segment, which the
learner trains as its own sequence. The model's text is never re-tokenized into the record.

Sampling is the run's (`envpool.temperature`, `top_p`): a request's own temperature is ignored,
so the behaviour logprobs match what the learner assumes. `max_tokens` may lower the budget of
one call, never raise it above `envpool.max_tokens`. `tool_choice` naming a function forces it:
the call opens with `<tool_call>{"name": ..., "arguments": {"<first string parameter>": "` as
prompt tokens and what the model generates (up to a `"`) is the argument's value.

Bounds: concurrent requests per episode (`envpool.agent_max_concurrent_requests`), request body
size (`envpool.agent_max_request_bytes`), calls per episode (`envpool.max_turns`), the context
(`actor.max_model_len`), and every wait (`envpool.turn_timeout_s`).
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from millstream.envpool.actors.client import TurnClient
from millstream.envpool.actors.generation import Generation, GenerationFailed, Retry, Sampling
from millstream.envpool.agents.toolcalls import ParsedReply, parse_tool_calls, tool_call_id
from millstream.envpool.chat import ChatFormat
from millstream.envpool.record import EpisodeRecord, EpisodeSpec
from millstream.envpool.seeds import sampling_seed
from millstream.shared.config import EnvPoolConfig
from millstream.shared.wire import Truncation

__all__ = ["Endpoint", "MODEL_NAME", "ApiError"]

#: What `GET /v1/models` lists; requests may name any model (there is one policy).
MODEL_NAME = "millstream-policy"


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}
        return JSONResponse(body, status_code=self.status)


@dataclass
class _Episode:
    spec: EpisodeSpec
    api_key: str
    record: EpisodeRecord
    requests: anyio.Semaphore
    failure: GenerationFailed | None = None
    seeds: list[int] = field(default_factory=list)


class Endpoint:
    """The worker's endpoint: one server, one route per live episode (`episode(spec)`)."""

    def __init__(
        self,
        chat: ChatFormat,
        client: TurnClient,
        cfg: EnvPoolConfig,
        max_model_len: Callable[[], int],
        host: str = "127.0.0.1",
    ) -> None:
        self.chat, self.client, self.cfg, self.max_model_len = chat, client, cfg, max_model_len
        self.sampling = Sampling.for_turns(cfg, chat.stop_token_ids)
        self.retry = Retry.from_config(cfg)
        self.host = host
        self.port = 0
        self.episodes: dict[str, _Episode] = {}
        prefix = "/episodes/{episode}/v1"
        self.app = Starlette(
            routes=[
                Route(f"{prefix}/chat/completions", self._chat_route, methods=["POST"]),
                Route(f"{prefix}/completions", self._completions_route, methods=["POST"]),
                Route(f"{prefix}/models", self._models_route, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_error},
        )

    # --- serving -------------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; `port` is set (and the task started) once it listens."""
        from hypercorn.config import Config as ServerConfig
        from hypercorn.trio import serve

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))  # a free port, chosen by the kernel at bind: no race
        self.port = sock.getsockname()[1]
        # Listening now, before `started`: hypercorn listens only after its startup, and an agent
        # connecting in between would be refused. Connections wait in the backlog meanwhile.
        sock.listen(1024)
        config = ServerConfig()
        config.bind = [f"fd://{sock.detach()}"]
        config.accesslog = None
        config.keep_alive_timeout = self.cfg.turn_timeout_s
        never = anyio.Event()  # stopped by cancellation, never by a signal of its own
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve(self.app, config, shutdown_trigger=never.wait))  # type: ignore[arg-type]
            task_status.started(self.port)

    @contextmanager
    def episode(self, spec: EpisodeSpec) -> Iterator[tuple[str, str, EpisodeRecord]]:
        """Open the episode's route for the `with` block: (base_url, api_key, record)."""
        ep = _Episode(
            spec,
            secrets.token_urlsafe(16),
            EpisodeRecord(spec),
            anyio.Semaphore(self.cfg.agent_max_concurrent_requests),
        )
        self.episodes[spec.episode_id] = ep
        try:
            yield f"http://{self.host}:{self.port}/episodes/{spec.episode_id}/v1", ep.api_key, ep.record
        finally:
            del self.episodes[spec.episode_id]
            ep.record.closed = True  # a call still in flight (an abandoned request) is not recorded
        if ep.failure is not None:  # the actor failed a call: the episode fails with its cause
            raise ep.failure

    # --- routes --------------------------------------------------------------------------------

    async def _chat_route(self, request: Request) -> Response:
        return await self._handle(request, self._chat)

    async def _completions_route(self, request: Request) -> Response:
        return await self._handle(request, self._completions)

    async def _models_route(self, request: Request) -> Response:
        try:
            self._episode(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "millstream"}]}
        )

    async def _handle(self, request: Request, what) -> Response:
        try:
            ep = self._episode(request)
            body = await self._body(request)
            if body.get("n", 1) != 1:
                raise ApiError(400, f"n={body.get('n')!r}: only n=1 is supported", param="n")
            with anyio.fail_after(self.cfg.turn_timeout_s):
                await ep.requests.acquire()
            try:
                return await what(ep, body)
            finally:
                ep.requests.release()
        except ApiError as exc:
            return exc.response()
        except TimeoutError:
            return ApiError(
                429, "too many concurrent requests for this episode", "rate_limit_error"
            ).response()

    def _episode(self, request: Request) -> _Episode:
        ep = self.episodes.get(request.path_params["episode"])
        if ep is None:
            raise ApiError(404, "no such episode (unknown, or it has ended)", "not_found_error")
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {ep.api_key}"):
            raise ApiError(401, "wrong or missing API key for this episode", "authentication_error")
        return ep

    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.cfg.agent_max_request_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise ApiError(413, f"request body over {limit} bytes (envpool.agent_max_request_bytes)")
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.cfg.turn_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(
                            413, f"request body over {limit} bytes (envpool.agent_max_request_bytes)"
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"request body not received in {self.cfg.turn_timeout_s}s") from None
        try:
            body = orjson.loads(b"".join(chunks))
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    # --- the two generation routes -------------------------------------------------------------

    async def _chat(self, ep: _Episode, body: dict[str, Any]) -> Response:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of objects", param="messages")
        tools = body.get("tools") or None
        try:
            prompt = self.chat.apply([_plain(m) for m in messages], tools=tools, add_generation_prompt=True)
        except Exception as exc:  # the template rejected the conversation (raise_exception, ...)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        forced = _forced_call(body.get("tool_choice"), tools)
        opening = forced[0] if forced else ""
        prompt = prompt + (self.chat.encode(opening) if opening else [])
        gen, number = await self._generate(ep, prompt, body)
        text = self.chat.decode(gen.token_ids)
        reply = _forced_reply(text, forced, f"{number}") if forced else parse_tool_calls(text, f"{number}")
        ep.record.invalid_actions += reply.malformed  # malformed tool calls
        ep.record.add_call(prompt, gen, opening + text)
        finish = "tool_calls" if reply.tool_calls else _finish(gen)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        usage = _usage(prompt, gen)
        ident = f"chatcmpl-{ep.spec.episode_id}-{number}"
        if body.get("stream"):
            return _stream(_chat_chunks(ident, message, finish, usage, body))
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return JSONResponse(_envelope(ident, "chat.completion", [choice], usage))

    async def _completions(self, ep: _Episode, body: dict[str, Any]) -> Response:
        prompt_in = body.get("prompt")
        if isinstance(prompt_in, list) and prompt_in and all(isinstance(t, int) for t in prompt_in):
            prompt = list(prompt_in)  # token ids: token in, as is
        elif isinstance(prompt_in, str) and prompt_in:
            prompt = self.chat.encode(prompt_in)
        else:
            raise ApiError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
        gen, number = await self._generate(ep, prompt, body)
        text = self.chat.decode(gen.token_ids)
        ep.record.add_call(prompt, gen, text)
        usage = _usage(prompt, gen)
        ident = f"cmpl-{ep.spec.episode_id}-{number}"
        choice = {"index": 0, "text": text, "finish_reason": _finish(gen), "logprobs": None}
        if body.get("stream"):
            chunk = _envelope(ident, "text_completion", [choice], None)
            return _stream(iter([chunk]))
        return JSONResponse(_envelope(ident, "text_completion", [choice], usage))

    async def _generate(
        self, ep: _Episode, prompt: list[int], body: dict[str, Any]
    ) -> tuple[Generation, int]:
        cfg, record = self.cfg, ep.record
        if record.turns + len(ep.seeds) >= cfg.max_turns:  # seeds: calls in flight
            record.truncated = Truncation.MAX_TURNS
            raise ApiError(400, f"this episode has used its {cfg.max_turns} calls (envpool.max_turns)")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or cfg.max_tokens
        if not isinstance(asked, int) or asked < 1:
            raise ApiError(400, f"max_tokens must be a positive integer, got {asked!r}", param="max_tokens")
        max_tokens = min(asked, cfg.max_tokens)
        if len(prompt) + max_tokens > self.max_model_len():
            record.truncated = Truncation.CONTEXT_FULL
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; with max_tokens {max_tokens} that exceeds "
                f"the context of {self.max_model_len()}",
                param="messages",
            )
        number = record.turns + len(ep.seeds)
        seed = sampling_seed(ep.spec.seed, ep.spec.member, number)
        ep.seeds.append(seed)
        try:
            sampling = msgspec.structs.replace(self.sampling, max_tokens=max_tokens)
            gen = await self.client.generate(
                prompt, sampling, seed=seed, retry=self.retry, affinity=ep.spec.episode_id
            )
        except GenerationFailed as exc:
            ep.failure = ep.failure or exc
            raise ApiError(503, f"the model failed: {exc}", "server_error") from None
        finally:
            ep.seeds.remove(seed)
        return gen, number


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, str(exc.detail), kind).response()


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: content a string (OpenAI allows None and text parts)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    plain = {**message, "content": content or ""}
    if message.get("tool_calls"):
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


def _forced_call(choice: Any, tools: list[dict] | None) -> tuple[str, str, str | None] | None:
    """For `tool_choice` naming a function: (opening text, function name, string argument)."""
    if not isinstance(choice, dict) or not tools:
        return None
    name = str((choice.get("function") or {}).get("name"))
    tool = next((t for t in tools if (t.get("function") or {}).get("name") == name), None)
    if tool is None:
        raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    props = (tool["function"].get("parameters") or {}).get("properties") or {}
    arg = next((k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"), None)
    head = '<tool_call>\n{"name": ' + orjson.dumps(name).decode() + ', "arguments": '
    return (head + "{" + orjson.dumps(arg).decode() + ': "', name, arg) if arg else (head, name, None)


def _forced_reply(text: str, forced: tuple[str, str, str | None], prefix: str) -> ParsedReply:
    opening, name, arg = forced
    if arg is None:  # the model writes the arguments object itself
        return parse_tool_calls(opening + text, prefix)
    value = text.split('"', 1)[0]
    arguments = orjson.dumps({arg: value}).decode()
    call = {
        "id": tool_call_id(prefix, 0),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return ParsedReply("", [call])


def _finish(gen: Generation) -> str:
    return "length" if gen.finish_reason == "length" else "stop"


def _usage(prompt: list[int], gen: Generation) -> dict[str, int]:
    n = len(gen.token_ids)
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def _envelope(ident: str, obj: str, choices: list, usage: dict | None) -> dict[str, Any]:
    out = {"id": ident, "object": obj, "created": int(time.time()), "model": MODEL_NAME, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def _chat_chunks(ident: str, message: dict, finish: str, usage: dict, body: dict) -> Iterator[dict]:
    """The whole reply as a stream: the actor path returns a turn at once, so one delta each."""

    def chunk(delta: dict, reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        return _envelope(ident, "chat.completion.chunk", [choice], None)

    yield chunk({"role": "assistant", "content": ""})
    if message["content"]:
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls", [])):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        yield {**_envelope(ident, "chat.completion.chunk", [], None), "usage": usage}


def _stream(chunks: Iterator[dict]) -> StreamingResponse:
    async def events():
        for c in chunks:
            yield b"data: " + orjson.dumps(c) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")

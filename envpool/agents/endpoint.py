"""An OpenAI-compatible endpoint per episode, served by the envpool worker on its own event loop.

An agent environment (envpool/agents/episode.py) gets, per episode,

    base_url = http://127.0.0.1:PORT/episodes/<episode_id>/v1    api_key = <random, per episode>

and talks to it with the official `openai` client (or anything that speaks the API):
`POST chat/completions` (streamed or not, `tools` and `tool_calls`, `n` samples), `POST
completions` (a text prompt or a list of token ids), `GET models`. It is a starlette app served by
hypercorn on the worker's trio loop, bound to loopback only; an unknown or finished episode gets a
404 and a wrong key a 401, each with an OpenAI-style error body. Every request field is honoured
as `vllm serve` honours it or refused with a 400 that names it (envpool/agents/requests.py says
which is which); none is silently ignored.

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

Sampling is the run's (`envpool.temperature`, `top_p`), so the behaviour logprobs match what the
learner assumes: a request may send those two only at the run's values. `max_tokens` may lower the
budget of one call, never raise it above `envpool.max_tokens`. Stop strings, `seed`, `n`,
`logprobs`, `echo` and `return_token_ids` behave as in vLLM's server (envpool/agents/responses.py
applies stop strings to the tokens). `tool_choice` "required" or naming a function forces a call:
the reply opens with a `<tool_call>` block as prompt tokens (envpool/agents/toolcalls.py), which
refused for a template with a tool-call format of its own (`ChatFormat.tool_format`); "none"
parses no call.

Bounds: concurrent requests per episode (`envpool.agent_max_concurrent_requests`), request body
size (`envpool.agent_max_request_bytes`), calls per episode (`envpool.max_turns`), the context
(`actor.max_model_len`), and every wait (`envpool.turn_timeout_s`).
"""

from __future__ import annotations

import secrets
import socket
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
from millstream.envpool.agents.requests import (
    ApiError,
    CallOptions,
    ChatRequest,
    RunSampling,
    parse_chat,
    parse_completion,
)
from millstream.envpool.agents.responses import (
    MODEL_NAME,
    Reply,
    chat_chunks,
    cut_at_stop,
    envelope,
    logprobs_of,
    raw_text,
    usage,
)
from millstream.envpool.agents.splice import Splicer
from millstream.envpool.agents.toolcalls import ForcedCall, ParsedReply, forced_call, parse_reply
from millstream.envpool.agents.toolformats import FORMATS, SPECIAL_MARKERS, detect
from millstream.envpool.chat import ChatFormat
from millstream.envpool.record import EpisodeRecord, EpisodeSpec
from millstream.envpool.seeds import request_seed, sampling_seed
from millstream.shared.config import EnvPoolConfig
from millstream.shared.wire import Truncation

__all__ = ["Endpoint", "MODEL_NAME", "ApiError"]


@dataclass
class _Episode:
    spec: EpisodeSpec
    api_key: str
    record: EpisodeRecord
    requests: anyio.Semaphore
    splicer: Splicer
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
        self.run_sampling = RunSampling(
            cfg.max_tokens, cfg.temperature, cfg.top_p, strict=cfg.agent_request_sampling == "refuse"
        )
        # The model's tool-call format (vLLM's parser names), from the config or its template;
        # forced calls open a Hermes block, so only where that is the model's format or the
        # template shows no tools at all (then no format is the model's own).
        found = detect(chat.template_text)
        self.tool_format = (found or "hermes") if cfg.tool_call_parser == "auto" else cfg.tool_call_parser
        self.forces_hermes = self.tool_format == "hermes" and (found == "hermes" or not chat.renders_tools)
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
            Splicer(self.chat),
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
            return _error(exc)
        return JSONResponse(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "millstream"}]}
        )

    async def _handle(self, request: Request, what) -> Response:
        try:
            ep = self._episode(request)
            body = await self._body(request)
            with anyio.fail_after(self.cfg.turn_timeout_s):
                await ep.requests.acquire()
            try:
                return await what(ep, body)
            finally:
                ep.requests.release()
        except ApiError as exc:
            return _error(exc)
        except TimeoutError:
            return _error(ApiError(429, "too many concurrent requests for this episode", "rate_limit_error"))

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
        req = parse_chat(body, self.run_sampling, arguments_as_object=self.tool_format != "deepseek_v3")
        context = (req.tools, req.template_kwargs)
        prompt = ep.splicer.prompt(req.messages, context) if self.cfg.agent_splice_replies else None
        if prompt is None:
            try:
                prompt = self.chat.apply(req.messages, tools=req.tools, template_kwargs=req.template_kwargs)
            except Exception as exc:  # the template rejected the conversation (raise_exception, ...)
                raise ApiError(
                    400, f"the chat template rejected the messages: {exc}", param="messages"
                ) from None
        forced = self._forced_call(req)
        opening = forced.opening if forced else ""
        prompt = prompt + (self.chat.encode(opening) if opening else [])
        replies, number = await self._sample(ep, prompt, req.options)
        choices = []
        for i, reply in enumerate(replies):
            marked = self.tool_format in SPECIAL_MARKERS and req.tool_choice != "none"
            parsed = parse_reply(
                raw_text(self.chat, reply.gen.token_ids) if marked else reply.text,
                req.tool_choice,
                forced,
                req.parallel_tool_calls,
                f"{number + i}",
                FORMATS[self.tool_format],
            )
            if marked and not parsed.tool_calls and not parsed.malformed:
                parsed = ParsedReply(reply.text)  # no call: the text as shown, special tokens out
            ep.record.invalid_actions += parsed.malformed  # malformed tool calls
            ep.record.add_call(prompt, reply.gen, opening + reply.text)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            ep.splicer.remember(req.messages, context, prompt, reply.gen.token_ids, message)
            choice = {
                "index": i,
                "message": message,
                "finish_reason": "tool_calls" if parsed.tool_calls else reply.finish_reason,
                "stop_reason": reply.stop_reason,
                "logprobs": logprobs_of(self.chat, reply.gen, chat_shape=True)
                if req.options.logprobs
                else None,
            }
            if req.options.return_token_ids:
                choice["token_ids"] = reply.gen.token_ids
            choices.append(choice)
        use = usage(prompt, replies)
        ident = f"chatcmpl-{ep.spec.episode_id}-{number}"
        if req.options.stream:
            return stream(chat_chunks(ident, choices, use, req.options.include_usage))
        extra = {"prompt_token_ids": prompt} if req.options.return_token_ids else {}
        return JSONResponse(envelope(ident, "chat.completion", choices, use, **extra))

    async def _completions(self, ep: _Episode, body: dict[str, Any]) -> Response:
        req = parse_completion(body, self.run_sampling)
        prompt = req.prompt if isinstance(req.prompt, list) else self.chat.encode(req.prompt)
        replies, number = await self._sample(ep, prompt, req.options)
        echoed = (
            "" if not req.echo else req.prompt if isinstance(req.prompt, str) else self.chat.decode(prompt)
        )
        choices = []
        for i, reply in enumerate(replies):
            ep.record.add_call(prompt, reply.gen, reply.text)
            choice = {
                "index": i,
                "text": echoed + reply.text,
                "finish_reason": reply.finish_reason,
                "stop_reason": reply.stop_reason,
                "logprobs": logprobs_of(self.chat, reply.gen, chat_shape=False)
                if req.options.logprobs
                else None,
            }
            if req.options.return_token_ids:
                choice |= {"prompt_token_ids": prompt, "token_ids": reply.gen.token_ids}
            choices.append(choice)
        use = usage(prompt, replies)
        ident = f"cmpl-{ep.spec.episode_id}-{number}"
        if req.options.stream:
            chunks = [envelope(ident, "text_completion", [c], None) for c in choices]
            if req.options.include_usage:
                chunks.append(envelope(ident, "text_completion", [], use))
            return stream(iter(chunks))
        return JSONResponse(envelope(ident, "text_completion", choices, use))

    def _forced_call(self, req: ChatRequest) -> ForcedCall | None:
        call = forced_call(req.tool_choice, req.forced_function, req.tools)
        if call is not None and not self.forces_hermes:
            how = f"as {self.tool_format}" if self.tool_format != "hermes" else "in a format of its own"
            raise ApiError(
                400,
                f"tool_choice={req.tool_choice!r}: a forced call opens the reply with a <tool_call> "
                f"block (the Hermes/Qwen format), and this model's template ({self.chat.source}) "
                f"writes tool calls {how}; send tool_choice auto",
                param="tool_choice",
            )
        return call

    async def _sample(self, ep: _Episode, prompt: list[int], opts: CallOptions) -> tuple[list[Reply], int]:
        """`opts.n` replies to one prompt (concurrently), stop strings applied; and the number of
        the first call (each reply is a call of the episode, with its own seed)."""
        cfg, record = self.cfg, ep.record
        if record.turns + len(ep.seeds) + opts.n > cfg.max_turns:  # seeds: calls in flight
            record.truncated = Truncation.MAX_TURNS
            raise ApiError(400, f"this episode has used its {cfg.max_turns} calls (envpool.max_turns)")
        if len(prompt) + opts.max_tokens > self.max_model_len():
            record.truncated = Truncation.CONTEXT_FULL
            raise ApiError(
                400,
                f"the prompt has {len(prompt)} tokens; with max_tokens {opts.max_tokens} that exceeds "
                f"the context of {self.max_model_len()}",
                param="messages",
            )
        first = record.turns + len(ep.seeds)
        seeds = [
            sampling_seed(ep.spec.seed, ep.spec.member, first + i)
            if opts.seed is None
            else request_seed(ep.spec.seed, ep.spec.member, opts.seed, i)
            for i in range(opts.n)
        ]
        ep.seeds.extend(seeds)
        sampling = msgspec.structs.replace(
            self.sampling, max_tokens=opts.max_tokens, top_logprobs=opts.top_logprobs
        )
        gens: list[Generation | GenerationFailed | None] = [None] * opts.n

        async def one(i: int) -> None:
            try:
                gens[i] = await self.client.generate(
                    prompt, sampling, seed=seeds[i], retry=self.retry, affinity=ep.spec.episode_id
                )
            except GenerationFailed as exc:
                gens[i] = exc

        try:
            async with anyio.create_task_group() as tg:
                for i in range(opts.n):
                    tg.start_soon(one, i)
        finally:
            for seed in seeds:
                ep.seeds.remove(seed)
        failed = next((g for g in gens if isinstance(g, GenerationFailed)), None)
        if failed is not None:
            ep.failure = ep.failure or failed
            raise ApiError(503, f"the model failed: {failed}", "server_error")
        done = [g for g in gens if isinstance(g, Generation)]
        assert len(done) == opts.n, gens  # every task ended with a generation or a failure
        return [cut_at_stop(self.chat, g, opts.stop, opts.include_stop) for g in done], first


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(ApiError(exc.status_code, str(exc.detail), kind))


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def stream(chunks: Iterator[dict]) -> StreamingResponse:
    """Server-sent events, as OpenAI streams: one `data:` line per chunk, then `[DONE]`."""

    async def events():
        for c in chunks:
            yield b"data: " + orjson.dumps(c) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")

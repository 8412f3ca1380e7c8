"""The synthetic engine served over HTTP, for the asyncio + HTTP baseline of bench/pool_vs_http.py.

    python -m millstream.bench.baselines.http_engine PORT MODEL_DIR [key=value ...]

`POST /generate {"prompt_token_ids": [...], "max_tokens": N}` answers, when the request finishes,
with its token ids and logprobs as JSON. Behind it runs the synthetic actor's own engine
(`actor/synthetic.py`: admission, slots, steps, token draws, the `key=value` config overrides
such as `actor.synthetic_step_s=0`), so both sides of the benchmark talk to the same engine and
differ only in how they reach it: ZeroMQ + msgspec for envpool, aiohttp + JSON here. The
engine's deltas land in a per-request reply instead of a socket (`_Replies`). Loopback only.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from typing import Any

from aiohttp import web

from millstream.actor.synthetic import SyntheticActor, model_vocab
from millstream.shared.config import load_config
from millstream.shared.wire import GenerateError, GenerateRequest, Message, TokenDelta

__all__ = ["app"]

PEER = b"http"


class Refused(Exception):
    """The engine refused the request (answered 503 with the reason)."""


class _Replies:
    """Stands in for the actor's ROUTER channel: collects each request's deltas until its last."""

    authenticated = False

    def __init__(self) -> None:
        self.open: dict[str, tuple[list[int], list[float], asyncio.Future[str]]] = {}

    def send_nowait(self, message: Message, to: bytes = b"") -> None:
        entry = self.open.get(getattr(message, "request_id", ""))
        if entry is None:  # its handler is gone (the client went away): nobody to tell
            return
        ids, logprobs, done = entry
        if isinstance(message, TokenDelta):
            ids += message.token_ids
            logprobs += message.logprobs
            if message.finish_reason is not None and not done.done():
                done.set_result(message.finish_reason)
        elif isinstance(message, GenerateError) and not done.done():
            done.set_exception(Refused(f"{message.cause}: {message.message}"))

    def fail_all(self, task: asyncio.Task) -> None:
        """The engine task ended: every open request fails now instead of waiting forever."""
        for _, _, done in self.open.values():
            if not done.done():
                done.set_exception(RuntimeError(f"the synthetic engine stopped: {task!r}"))

    async def send(self, message: Message, to: bytes = b"") -> None:
        self.send_nowait(message, to)


def app(model: str, overrides: list[str]) -> web.Application:
    cfg = load_config(None, [f"model.path={model}", *overrides])
    vocab, eos = model_vocab(model)
    replies = _Replies()
    ids = itertools.count()
    engine: dict[str, Any] = {}

    async def start(application: web.Application) -> None:
        # Built inside the loop: the engine's events and locks belong to it.
        actor = SyntheticActor(replies, cfg, model=model, vocab_size=vocab, eos_id=eos)  # type: ignore[arg-type]
        engine["actor"], engine["task"] = actor, asyncio.ensure_future(actor._engine())
        engine["task"].add_done_callback(replies.fail_all)

    async def stop(application: web.Application) -> None:
        engine["task"].cancel()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        n = int(body["max_tokens"])
        rid = str(next(ids))
        token_ids: list[int] = []
        logprobs: list[float] = []
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        replies.open[rid] = (token_ids, logprobs, done)
        try:
            stops = list(body.get("stop_token_ids", []))
            req = GenerateRequest(rid, body["prompt_token_ids"], n, 1.0, 1.0, None, stops, False, 0)
            engine["actor"]._dispatch(None, PEER, req)
            finish = await done
        except Refused as exc:
            return web.json_response({"error": str(exc)}, status=503)
        finally:
            del replies.open[rid]
        return web.json_response({"token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish})

    application = web.Application()
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    application.router.add_post("/generate", generate)
    return application


def main() -> None:
    port, model, overrides = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    print("ready", flush=True)
    web.run_app(
        app(model, overrides), host="127.0.0.1", port=port, print=None, access_log=None, backlog=16384
    )


if __name__ == "__main__":
    main()

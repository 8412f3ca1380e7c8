"""The synthetic engine served over HTTP, for the asyncio + HTTP baseline of bench/pool_vs_http.py.

    python -m millstream.bench.http_engine PORT MODEL_DIR

`POST /generate {"prompt_token_ids": [...], "max_tokens": N}` answers at once with N random token
ids (never the end-of-sequence one) and their logprobs, as JSON: the same work as the synthetic
actor in its never-the-bottleneck settings, over aiohttp instead of ZeroMQ. Loopback only.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from aiohttp import web


def app(vocab: int) -> web.Application:
    rng = random.Random(0)
    logprob = -math.log(vocab)

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        n = int(body["max_tokens"])
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        return web.json_response({"token_ids": ids, "logprobs": [logprob] * n, "version": 0})

    application = web.Application()
    application.router.add_post("/generate", generate)
    return application


def main() -> None:
    port, model = int(sys.argv[1]), Path(sys.argv[2])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    print("ready", flush=True)
    web.run_app(app(vocab), host="127.0.0.1", port=port, print=None, access_log=None, backlog=16384)


if __name__ == "__main__":
    main()

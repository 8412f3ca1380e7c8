"""The run configuration's sections: every key, its type, its range and its meaning.

A config is a tree of msgspec Structs, one per section. Each field carries its documentation as
`msgspec.Meta(description=...)`, so `millstream config` prints every knob with its default and
meaning, and the docs never drift from the code. There are no hidden knobs: if a role reads a
number, it is here. A key with a fixed set of values is a `Literal`, so a value outside the set
is refused with the choices named. Loading, overrides and the checks that span several keys are
in `shared/config/load.py`.

The run-wide sections are here (run, model, train); how episodes are generated (actor,
envpool) is in `shared/config/rollout.py`, how the learner trains (learner) in
`shared/config/learning.py`, how the run's processes talk and are placed (transport, chaos,
launcher) in `shared/config/ops.py`, how it is scored and watched (eval, metrics, judge, store)
in `shared/config/scoring.py`. This module assembles the tree and re-exports every section.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from millstream.shared.config.learning import LearnerConfig
from millstream.shared.config.meta import doc as _doc
from millstream.shared.config.ops import ChaosConfig, LauncherConfig, TransportConfig
from millstream.shared.config.rollout import ActorConfig, EnvPoolConfig
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
    name: Annotated[
        str,
        _doc(
            "Run name; the run directory is `<root>/<name>-<timestamp>`: a folder name (no '/', "
            "not empty, not starting with '.'), so the run stays inside run.root."
        ),
    ] = "run"
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
    max_minutes: Annotated[
        float,
        _doc(
            "Minutes of training (the run's, across resumes) after which it ends as at train.steps: "
            "final checkpoint and summary (0: no limit). For allocations with a time limit, soaks.",
            ge=0,
        ),
    ] = 0.0
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

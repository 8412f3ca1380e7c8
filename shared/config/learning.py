"""The config section about how the learner trains (`[learner]`): its sockets, the optimizer, the
advantage estimator and group filter, the loss (clip, aggregation, staleness policy, KL,
entropy), checkpoints, ranks and ZeRO, LoRA, the weight broadcast, and the bounds on what it
takes. Apart from shared/config/schema.py only to keep each module readable; the same rules hold
(one doc line per field, ranges and choices in the types).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from millstream.shared.config.meta import CPUS_PATTERN
from millstream.shared.config.meta import doc as _doc

__all__ = ["LearnerConfig", "filter_pool_size"]


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
    max_failed_checkpoints: Annotated[
        int,
        _doc(
            "Checkpoints in a row that may fail (a full disk) while training goes on from the last "
            "complete one; one more stops the learner with the error. A failed final checkpoint "
            "always stops it. With learner.ranks > 1 the first failure stops it.",
            ge=0,
        ),
    ] = 3
    ranks: Annotated[
        int, _doc("Learner processes (DeepSpeed data parallel; the launcher starts each rank).", ge=1)
    ] = 1
    zero_stage: Annotated[int, _doc("DeepSpeed ZeRO stage.", ge=0, le=3)] = 2
    cpus: Annotated[
        str,
        _doc(
            "Cores the learner runs on (shared/process/cpus.py). auto: on a machine without a "
            "GPU, the cores the actor does not take (all of them on one core), torch running "
            "one thread per core; with a GPU or under Ray, unchanged. all: not pinned, torch's "
            "own thread count. A list such as '0-3,8' (one core: '1', quoted): those cores, "
            "split among the ranks when there are enough.",
            pattern=CPUS_PATTERN,
        ),
    ] = "auto"
    gpus: Annotated[
        str,
        _doc(
            "GPUs the learner runs on, under the local launcher (shared/process/gpus.py). auto: "
            "where the machine has a GPU for every actor engine and learner rank, the ones after "
            "the actor's; else the last ones, last first (rank 0 as far from the first engine "
            "as it goes), shared. all: every GPU visible. A list such as '2,3' (one GPU: '2', "
            "quoted): those GPUs, rank r on the r-th (one per rank at least). Under Ray, "
            "launcher.learner_gpus.",
            pattern=CPUS_PATTERN,
        ),
    ] = "auto"
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
    lora_dropout: Annotated[
        float,
        _doc(
            "Dropout on the LoRA adapters' input. Above 0, the training pass computes pi_theta "
            "under dropout while the actor sampled (and the decoupled proximal pass scored) "
            "without it: every ratio carries that noise (decoupled: r is no longer 1 in the "
            "step). 0 keeps them exact.",
            ge=0,
            lt=1,
        ),
    ] = 0.0
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
        _doc(
            "Weight broadcast backend: 'auto' (nccl when the learner and every actor worker have "
            "a GPU of their own, else gloo: NCCL refuses two processes on one GPU, as on a "
            "one-GPU run), 'gloo', 'nccl'."
        ),
    ] = "auto"
    sync_host: Annotated[str, _doc("Host of the broadcast group's TCPStore (the learner).")] = "127.0.0.1"
    sync_timeout_s: Annotated[float, _doc("Timeout of weight-group set-up and each broadcast.", gt=0)] = 300.0
    sync_bucket_mb: Annotated[
        float,
        _doc(
            "Size at which a weight push closes a piece of packed small tensors, MiB (a piece may "
            "pass it by one small tensor; tensors of 1 MiB or more are sent from where they lie, a "
            "piece each). The learner packs the next piece while this one is on the wire; 8-128 MiB "
            "measured alike on gloo (bench/README, weight sync).",
            gt=0,
        ),
    ] = 32.0
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


def filter_pool_size(cfg: LearnerConfig, groups_per_batch: int) -> int:
    """Complete groups a batch takes as filter candidates: ceil(groups_per_batch / starpo_keep)
    for starpo_s (its `filter_groups` then keeps at least `groups_per_batch`), else
    groups_per_batch (zero_std tests each group as it completes, `ReplayBuffer.keep`, so the
    batch's groups all pass). Here, not in the learner: the config's checks need it too."""
    if cfg.group_filter != "starpo_s":
        return groups_per_batch
    # The tolerance absorbs binary noise: 3 / 0.3 is 10.000000000000002, and 11 is not meant.
    return max(groups_per_batch, math.ceil(groups_per_batch / cfg.starpo_keep - 1e-9))

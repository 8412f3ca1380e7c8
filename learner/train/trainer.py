"""One optimizer step over a batch of sampled sequences, under DeepSpeed.

The learner hands the trainer a list of `TrainSample`s (token ids, a loss mask, the behaviour
policy's per-token logprobs and per-token advantages); `Trainer.train_step` turns them into exactly
one optimizer step and returns plain-float metrics. `named_weights` and `save_pretrained` give the
updated weights to the weight broadcast and to disk, with Hugging Face names, so vLLM loads them.

    trainer = Trainer(model_dir, cfg.learner, seed=cfg.run.seed)
    budget = cfg.envpool.max_tokens * cfg.envpool.max_turns   # most generated tokens per sequence
    metrics = trainer.train_step(samples, cfg.learner, generation_budget=budget)
    for name, tensor in trainer.named_weights(): ...

The loss (learner/train/loss.py, docs/algorithms.md) is chosen per step by the `LearnerConfig` passed to
`train_step`: PPO clip with clip_low/clip_high; `loss_agg` token_mean / seq_mean / seq_sum_norm;
`staleness_policy` "drop" (ratio against the behaviour logprobs) or "decoupled" (AReaL's decoupled
PPO: proximal logprobs recomputed first, importance weight capped by `is_cap`); `kl_coef` /
`kl_estimator` (KL to the frozen initial policy); `entropy_coef`. Only `micro_batch_size`, the
optimizer and ZeRO settings, and the actor's sampling temperature (every logprob is of
softmax(logits / T), the distribution the tokens were drawn from) are fixed at construction.

Design choices:

- One process needs no launcher. If torch.distributed is not up and no launcher set RANK/WORLD_SIZE,
  we pose as rank 0 of a world of 1 on a free loopback port. Under `torchrun`/`deepspeed` the
  launcher's variables win and every rank runs the same code (the learner shards samples per rank).
- Loss normalisation is exact across micro-batches (learner/train/plan.py: how a step's samples
  are cut into micro-batches and counted over the ranks, and how its metrics are reduced).
- Gradient accumulation: DeepSpeed normally fixes `gradient_accumulation_steps` (GAS) in the
  config, divides every loss by it in `backward`, and updates on its own micro-step counter. Our
  number of micro-batches changes from step to step, so GAS stays 1 (dividing by 1 is a no-op: the
  loss needs no compensation) and we mark the boundary with
  `engine.set_gradient_accumulation_boundary`: False before every micro-batch but the last, True
  before the last, then ONE `engine.step()` (reduction, clipping, AdamW update). Checked in
  deepspeed 0.19.8 against a plain PyTorch step for ZeRO 0-3, one and two ranks. Its newer
  `managed_gradient_accumulation: false` mode (step() is the boundary) passed the same checks; we
  keep the boundary call because it is the long-documented API, not a recent addition.
- Data parallel: each rank passes its own shard. Token and sequence counts are all-reduced so the
  loss is normalised over every rank's data, and ranks run as many micro-batches (ZeRO-2/3 reduce
  inside backward and ZeRO-3 gathers parameters inside every forward, so a rank with fewer repeats
  its last one at weight 0, in the proximal pass too). Metrics are global.
- Decoupled PPO needs the proximal policy's logprobs: the current weights before this step's
  update. A no-grad forward pass over the whole batch (engine in eval mode: no dropout) computes
  them before the first backward. It costs one extra forward per step (about a third of a step's
  compute). Since a step is ONE optimizer update, proximal = current weights during the step, so
  the ratio r = p / p_prox starts (and stays) at 1: the clip is inactive and the decoupled loss
  acts as a capped importance-weighted policy gradient `-w' * A * grad logp`.
- KL penalty: with `kl_coef > 0` at construction the trainer keeps a frozen reference, a plain
  torch copy of the initial weights (`model_dir`, the same dtype as training: bf16 or fp32), in
  eval mode without grads, on the engine's device. Memory: one more full copy of the weights per
  rank (2 bytes/param in bf16, 4 in fp32) plus one micro-batch of no-grad activations and logits.
  Under ZeRO-3 the policy's weights, gradients and optimizer state are sharded across ranks but the
  reference is NOT: every rank holds all of it, so for a model that needs ZeRO-3 to fit the
  reference can cost more than the rank's policy shard (ZeRO-3-partitioning it through a second,
  optimizer-less DeepSpeed engine would fix that; not done here). Its forward involves no
  collectives. The reference comes from `model_dir`, not from a checkpoint, so a resumed run keeps
  the original reference. Without the penalty no reference exists and `kl` is not reported; a
  Trainer built with kl_coef > 0 still reports `kl` on steps whose config sets kl_coef to 0.
- LoRA (`lora_rank > 0`, learner/train/lora.py): the model is wrapped with peft before DeepSpeed, the
  optimizer gets only the adapter parameters, and `named_weights` yields merged full weights
  under the base names, so the broadcast, the actor and `save_pretrained` see a plain model.
- Weights are fp32 on CPU. `dtype="bfloat16"` turns on DeepSpeed bf16 (bf16 module, fp32 master
  copy in the ZeRO optimizer); the weights handed out then are bf16, as the actor wants on GPU.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from millstream.learner.persist.hfexport import save_model_dir
from millstream.learner.train import lora
from millstream.learner.train.batching import PAD_ID, TrainSample
from millstream.learner.train.dssetup import ds_config, import_deepspeed, init_distributed
from millstream.learner.train.loss import aggregation_weights, gather_logprobs, rl_loss, sequence_logprobs
from millstream.learner.train.plan import StepPlan, accumulate, plan_step, step_metrics
from millstream.shared.config import LearnerConfig

__all__ = ["TrainSample", "Trainer", "PAD_ID"]

_Logprobs = list[torch.Tensor]  # one [B, T] tensor per micro-batch


class Trainer:
    """A causal LM under a DeepSpeed engine that takes one PPO-clip step per `train_step` call.

    `engine` is public for checkpointing (`engine.save_checkpoint` / `load_checkpoint`).
    `reference` is the frozen initial policy (a plain torch module) when `learner_cfg.kl_coef > 0`,
    else None; see the module docstring for its memory cost, under ZeRO-3 especially.
    """

    def __init__(
        self,
        model_dir: str,
        learner_cfg: LearnerConfig,
        *,
        seed: int,
        dtype: str = "float32",
        collective_timeout_s: float | None = None,
        temperature: float = 1.0,
    ) -> None:
        if dtype not in ("float32", "bfloat16"):
            # fp16 would need loss scaling and overflow handling; nothing here wants it.
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        from transformers import AutoModelForCausalLM

        deepspeed = import_deepspeed()
        ours = init_distributed(deepspeed, collective_timeout_s)
        try:
            torch.manual_seed(seed)
            self.model_dir = Path(model_dir).expanduser()
            self.micro_batch_size = learner_cfg.micro_batch_size
            self.lora = learner_cfg.lora_rank > 0
            if self.lora:  # a misnamed target fails before any weights load
                lora.check_targets(self.model_dir, learner_cfg.lora_target_modules)
            # fp32 master weights; DeepSpeed casts the module to bf16 itself when bf16 is on.
            model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
            model.config.use_cache = False  # training never reuses a KV cache
            if self.lora:  # base frozen: the optimizer sees only the adapters (learner/train/lora.py)
                model = lora.wrap(model, learner_cfg)
            optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=learner_cfg.lr,
                weight_decay=learner_cfg.weight_decay,
                betas=(learner_cfg.adam_beta1, learner_cfg.adam_beta2),
                eps=learner_cfg.adam_eps,
            )
            self.engine, *_ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=ds_config(learner_cfg, dtype)
            )
            self.reference: torch.nn.Module | None = None
            if learner_cfg.kl_coef > 0:
                # Loaded after deepspeed.initialize, so a ZeRO-3 engine never sees it: a whole,
                # unsharded copy on every rank (module docstring).
                ref = AutoModelForCausalLM.from_pretrained(
                    str(self.model_dir), dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32
                )
                ref.config.use_cache = False
                self.reference = ref.to(self.engine.device).eval().requires_grad_(False)
        finally:
            # Our stand-in launcher variables must not leak into child processes (an actor or
            # a learner started from here would try to join this process's group), and gloo's
            # interface goes back to what it was (a weight group to another host picks its own).
            for key, before in ours.items():
                if before is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = before
        self.device = self.engine.device
        self._zero3 = learner_cfg.zero_stage == 3
        #: The actor's sampling temperature: every pass computes the logprobs of softmax(z / T),
        #: the distribution the tokens were drawn from and the actor's logprobs describe.
        self.temperature = temperature

    @property
    def version(self) -> int:
        """Optimizer steps done so far (0 before the first).

        The engine's own step counter, so `engine.load_checkpoint` restores it with the weights."""
        return int(self.engine.global_steps)

    # ---------------------------------------------------------------- training

    def _all_reduce(self, values: list[float] | torch.Tensor, op: str) -> list[float]:
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        if self.engine.dp_world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def _logits(self, module: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return module(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).logits

    @torch.no_grad()
    def _frozen_logprobs(
        self, batches: list[dict[str, torch.Tensor]], n_chunks: int, *, proximal: bool
    ) -> tuple[_Logprobs | None, _Logprobs | None]:
        """No-grad passes before the update: proximal logprobs (the engine's current weights, eval
        mode) and reference logprobs, one [B, T] tensor per micro-batch, or None where not needed.

        The proximal pass runs `n_chunks` forwards on every rank (ZeRO-3 gathers parameters
        collectively inside each), repeating the last micro-batch; the reference is a plain module.
        """
        prox: _Logprobs | None = [] if proximal else None
        ref: _Logprobs | None = [] if self.reference is not None else None
        if proximal:
            self.engine.eval()
        for k in range(n_chunks):
            batch = batches[min(k, len(batches) - 1)]
            if prox is not None:
                logp = gather_logprobs(
                    self._logits(self.engine, batch), batch["ids"], temperature=self.temperature
                )
                if k < len(batches):
                    prox.append(logp)
            if ref is not None and k < len(batches):
                ref_logits = self._logits(self.reference, batch)
                ref.append(gather_logprobs(ref_logits, batch["ids"], temperature=self.temperature))
        return prox, ref

    def train_step(
        self, samples: list[TrainSample], cfg: LearnerConfig, *, generation_budget: int
    ) -> dict[str, float]:
        """One optimizer step over all `samples` with the loss `cfg` describes; plain-float metrics.

        `generation_budget` is the most generated tokens one sequence can have (envpool max_tokens
        x max_turns); only loss_agg="seq_sum_norm" uses it. From `cfg` this reads clip_low,
        clip_high, loss_agg, staleness_policy, is_cap, kl_coef, kl_estimator, entropy_coef; the
        micro-batch size and optimizer settings are the constructor's.

        With several data-parallel ranks every rank calls this with its own shard; normalisers
        count all ranks' data and the metrics are global. Metrics (means are per loss token):
          loss, pg_loss     the whole loss and its policy term (both aggregated by cfg.loss_agg)
          kl                mean estimate of KL(current || reference) (only with a reference)
          entropy           mean predictive entropy
          clip_frac         share of tokens whose gradient the PPO clip removed
          approx_kl         mean k3 KL vs the ratio's denominator (behaviour; proximal if decoupled)
          ratio_mean/max    of r = p / p_behav (drop) or p / p_prox (decoupled)
          is_weight_mean/max, is_capped_frac   decoupled only: raw w = p_prox / p_behav, and the
                            share of tokens dropped because w > is_cap
          grad_norm         global gradient norm before clipping
          tokens, sequences loss tokens and samples of the step; step_time_s
        """
        start = time.perf_counter()
        plan = self._plan(samples, cfg, generation_budget)
        prox, ref = self._frozen_logprobs(plan.batches, plan.n_chunks, proximal=plan.decoupled)
        self.engine.train()
        # Summed (or maxed) on the device and read once at the end: no host sync per micro-batch.
        sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        for k in range(plan.n_chunks):
            self._micro_step(plan, k, cfg, prox, ref, sums, maxes)
        local_norm = self._local_grad_norm()
        self.engine.step()  # the one boundary: reduce, clip, AdamW update, zero the grads
        elapsed_s = time.perf_counter() - start
        return step_metrics(
            plan,
            sums,
            maxes,
            grad_norm=self._grad_norm(local_norm),
            elapsed_s=elapsed_s,
            all_reduce=self._all_reduce,
        )

    def _plan(self, samples: list[TrainSample], cfg: LearnerConfig, generation_budget: int) -> StepPlan:
        """Check the samples, count them over all ranks, cut them into micro-batches."""
        return plan_step(
            samples,
            cfg,
            generation_budget,
            micro_batch_size=self.micro_batch_size,
            device=self.device,
            world=self.engine.dp_world_size,
            has_reference=self.reference is not None,
            all_reduce=self._all_reduce,
        )

    def _micro_step(
        self,
        plan: StepPlan,
        k: int,
        cfg: LearnerConfig,
        prox: _Logprobs | None,
        ref: _Logprobs | None,
        sums: dict[str, torch.Tensor],
        maxes: dict[str, torch.Tensor],
    ) -> None:
        """Forward and backward of micro-batch `k`; its statistics join `sums` and `maxes`."""
        repeat = k >= len(plan.batches)  # this rank ran out: its last micro-batch at weight 0
        i = min(k, len(plan.batches) - 1)
        batch = plan.batches[i]
        # Only the last backward of the step may finish the gradient reduction.
        self.engine.set_gradient_accumulation_boundary(k == plan.n_chunks - 1)
        logits = self._logits(self.engine, batch)
        logp, entropy = sequence_logprobs(
            logits, batch["ids"], temperature=self.temperature, entropy_grad=cfg.entropy_coef > 0
        )
        # DeepSpeed averages gradients over ranks; scaling by `world` turns that average back
        # into the sum, so the step's loss is normalised by the totals over all ranks.
        weights = (
            aggregation_weights(
                batch["mask"],
                cfg.loss_agg,
                tokens=plan.total_tokens,
                sequences=plan.total_seqs,
                generation_budget=plan.generation_budget,
            )
            * plan.world
        )
        loss, stats = rl_loss(
            logp,
            entropy,
            batch["behav"],
            batch["adv"],
            batch["mask"],
            weights,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            prox_logp=prox[i] if prox is not None else None,
            is_cap=cfg.is_cap if plan.decoupled else None,
            ref_logp=ref[i] if ref is not None else None,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            entropy_coef=cfg.entropy_coef,
        )
        # Accumulates into the step's gradient; no optimizer update happens here.
        self.engine.backward(loss * (0.0 if repeat else 1.0))
        if not repeat:
            stats["loss"] = loss.detach()
            accumulate(stats, sums, maxes)

    def _local_grad_norm(self) -> float:
        # ZeRO-0 with a torch optimizer clips inside step() but keeps no norm, so we measure it
        # first. With one rank the local gradient is the global one; with more it is not reduced
        # yet, and measuring the reduced one would cost an extra all-reduce: report NaN instead.
        if self.engine.zero_optimization_stage() != 0 or self.engine.dp_world_size != 1:
            return math.nan
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
            if grads
            else 0.0
        )

    def _grad_norm(self, local_norm: float) -> float:
        # Global gradient norm before clipping, as ZeRO 1-3 measured it inside step().
        norm = self.engine.get_global_grad_norm()
        return local_norm if norm is None else float(norm)

    # ---------------------------------------------------------------- weights out

    def named_weights(self, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, with its Hugging Face name, in module order.

        Yields detached copies on CPU, so a consumer may keep them across later steps. With
        `copy=False` it yields the parameters themselves (detached, where they live), valid only
        until the next step: the weight push sends them before training goes on, and a copy of
        the model per push would cost its time and memory for nothing. Where the parameters are
        not whole tensors of their own (ZeRO-3 shards, LoRA's merged weights) it copies anyway.
        Under ZeRO-3 each parameter is gathered in turn (memory stays one tensor above the
        shard): every rank must iterate this generator to the end, since gathering is collective.
        """
        if self.lora:  # base + scale * B @ A under the base names (learner/train/lora.py)
            yield from lora.merged_weights(self.engine.module, self._gather_many if self._zero3 else None)
            return
        for name, param in self.engine.module.named_parameters():
            if not copy and not self._zero3:
                yield name, param.detach()
                continue
            with self._gathered(param) if self._zero3 else nullcontext():
                yield name, param.detach().to("cpu", copy=True)

    @staticmethod
    def _gathered(param: torch.nn.Parameter) -> Any:
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)

    @staticmethod
    def _gather_many(params: list[torch.nn.Parameter]) -> Any:
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def save_adapter(self, out_dir: str) -> None:
        """Write the LoRA adapter in peft's format (lora_rank > 0 only). Collective under ZeRO-3:
        call on every rank; rank 0 writes."""
        lora.save_adapter(
            self.engine.module,
            Path(out_dir),
            self._gather_many if self._zero3 else None,
            write=dist.get_rank() == 0,
        )

    def save_pretrained(self, out_dir: str) -> None:
        """Write a Hugging Face model directory of the current policy (learner/persist/hfexport.py).
        Collective under ZeRO-3: call on every rank; rank 0 writes."""
        weights = {name: t.contiguous() for name, t in self.named_weights()}
        if dist.get_rank() == 0:
            module = self.engine.module.get_base_model() if self.lora else self.engine.module
            save_model_dir(module, weights, self.model_dir, Path(out_dir))

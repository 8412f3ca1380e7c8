"""One optimizer step over a batch of sampled sequences, under DeepSpeed.

The learner hands the trainer a list of `TrainSample`s (token ids, a loss mask, the behaviour
policy's per-token logprobs and per-token advantages); `Trainer.train_step` turns them into exactly
one optimizer step and returns plain-float metrics. `named_weights` and `save_pretrained` give the
updated weights to the weight broadcast and to disk, with Hugging Face names, so vLLM loads them.

    trainer = Trainer(model_dir, cfg.learner, seed=cfg.run.seed)
    metrics = trainer.train_step(samples, clip_low=0.2, clip_high=0.28)
    for name, tensor in trainer.named_weights(): ...

Design choices:

- One process needs no launcher. If torch.distributed is not up and no launcher set RANK/WORLD_SIZE,
  we pose as rank 0 of a world of 1 on a free loopback port. Under `torchrun`/`deepspeed` the
  launcher's variables win and every rank runs the same code (the learner shards samples per rank).
- Loss normalisation is token-mean over the whole step: every micro-batch sums its per-token losses
  and divides by the masked-token count of the *step*, so the micro-batch gradients add up to the
  gradient of one big batch whatever the micro-batch size. Long sequences weigh by their tokens.
- Gradient accumulation: DeepSpeed normally fixes `gradient_accumulation_steps` (GAS) in the
  config, divides every loss by it in `backward`, and updates on its own micro-step counter. Our
  number of micro-batches changes from step to step, so GAS stays 1 (dividing by 1 is a no-op: the
  loss needs no compensation) and we mark the boundary with
  `engine.set_gradient_accumulation_boundary`: False before every micro-batch but the last, True
  before the last, then ONE `engine.step()` (reduction, clipping, AdamW update). Checked in
  deepspeed 0.19.8 against a plain PyTorch step for ZeRO 0-3, one and two ranks. Its newer
  `managed_gradient_accumulation: false` mode (step() is the boundary) passed the same checks; we
  keep the boundary call because it is the long-documented API, not a recent addition.
- Data parallel: each rank passes its own shard. The token count is all-reduced so the loss is the
  token mean over every rank's tokens, and ranks run as many micro-batches (ZeRO-2/3 reduce inside
  backward, so a rank with fewer repeats its last one at weight 0). Metrics are global.
- Sequences are sorted by length before they are cut into micro-batches: less padding, same sum.
- Weights are fp32 on CPU. `dtype="bfloat16"` turns on DeepSpeed bf16 (bf16 module, fp32 master
  copy in the ZeRO optimizer); the weights handed out then are bf16, as the actor wants on GPU.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from learner.loss import ppo_clip_loss, sequence_logprobs
from shared.config import LearnerConfig

__all__ = ["TrainSample", "Trainer", "PAD_ID"]

#: Right-padding token id; padded positions carry attention_mask 0 and loss mask 0.
PAD_ID = 0

# Tokenizer files copied next to the saved weights (the rest of the model dir is weights/config).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "chat_template.jinja", "chat_template.json")


@dataclass
class TrainSample:
    """One sequence to train on; all four lists have the same length."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 where the model generated the token and it carries loss
    behav_logprobs: list[float]  # behaviour-policy logprob per token (0.0 where mask is 0)
    advantages: list[float]  # per-token advantage (already broadcast)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_deepspeed() -> Any:
    # DeepSpeed picks its accelerator once, at import; say "cpu" explicitly rather than rely on
    # detection. Imported lazily because it takes seconds and `import learner.trainer` should not.
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    if not torch.cuda.is_available():
        # The shared-memory comm op is a ~60 s g++ JIT build that a CPU run does not need.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _init_distributed(deepspeed: Any) -> list[str]:
    """Join (or, with no launcher, create) the default process group; return env keys we set."""
    ours: list[str] = []
    if not dist.is_initialized() and "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        # No launcher: be rank 0 of 1 (else DeepSpeed tries MPI discovery through mpi4py).
        env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        os.environ.update(env)
        ours = [k for k in env if k != "LOCAL_RANK"]  # every engine init reads LOCAL_RANK
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return ours


class Trainer:
    """A causal LM under a DeepSpeed engine that takes one PPO-clip step per `train_step` call.

    `engine` is public for checkpointing (`engine.save_checkpoint` / `load_checkpoint`).
    """

    def __init__(self, model_dir: str, learner_cfg: LearnerConfig, *, seed: int,
                 dtype: str = "float32") -> None:
        if dtype not in ("float32", "bfloat16"):
            # fp16 would need loss scaling and overflow handling; nothing here wants it.
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        from transformers import AutoModelForCausalLM

        deepspeed = _import_deepspeed()
        ours = _init_distributed(deepspeed)
        try:
            torch.manual_seed(seed)
            self.model_dir = Path(model_dir).expanduser()
            self.micro_batch_size = learner_cfg.micro_batch_size
            # fp32 master weights; DeepSpeed casts the module to bf16 itself when bf16 is on.
            model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
            model.config.use_cache = False  # training never reuses a KV cache
            optimizer = torch.optim.AdamW(model.parameters(), lr=learner_cfg.lr,
                                          weight_decay=learner_cfg.weight_decay,
                                          betas=(learner_cfg.adam_beta1, learner_cfg.adam_beta2),
                                          eps=learner_cfg.adam_eps)
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=self._ds_config(learner_cfg, dtype))
        finally:
            # Our stand-in launcher variables must not leak into child processes (an actor or
            # a learner started from here would try to join this process's group).
            for key in ours:
                os.environ.pop(key, None)
        self.device = self.engine.device
        self._zero3 = learner_cfg.zero_stage == 3

    @staticmethod
    def _ds_config(cfg: LearnerConfig, dtype: str) -> dict[str, Any]:
        world = dist.get_world_size()
        return {
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            # GAS 1: backward's `loss / GAS` is a no-op, so our token-mean normaliser is the only
            # scaling; train_step marks the accumulation boundary itself (any number of
            # micro-batches per step). train_batch_size only feeds DeepSpeed's sample counter.
            "gradient_accumulation_steps": 1,
            "train_batch_size": cfg.micro_batch_size * world,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": cfg.zero_stage},
            "bf16": {"enabled": dtype == "bfloat16"},
            "zero_allow_untested_optimizer": True,  # torch AdamW as a client optimizer
            "steps_per_print": 1 << 30,  # no progress lines in our logs
            "wall_clock_breakdown": False,
        }

    @property
    def version(self) -> int:
        """Optimizer steps done so far (0 before the first).

        The engine's own step counter, so `engine.load_checkpoint` restores it with the weights."""
        return int(self.engine.global_steps)

    # ---------------------------------------------------------------- training

    def _batch(self, samples: list[TrainSample]) -> dict[str, torch.Tensor]:
        """Right-pad a micro-batch into tensors on the engine's device."""
        width = max(len(s.token_ids) for s in samples)
        out = {"ids": torch.full((len(samples), width), PAD_ID, dtype=torch.long),
               "attn": torch.zeros((len(samples), width), dtype=torch.long)}
        out.update({k: torch.zeros((len(samples), width)) for k in ("mask", "behav", "adv")})
        for i, s in enumerate(samples):
            t = len(s.token_ids)
            out["ids"][i, :t] = torch.tensor(s.token_ids, dtype=torch.long)
            out["attn"][i, :t] = 1
            out["mask"][i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
            out["behav"][i, :t] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
            out["adv"][i, :t] = torch.tensor(s.advantages, dtype=torch.float32)
        return {k: v.to(self.device) for k, v in out.items()}

    @staticmethod
    def _check(samples: list[TrainSample]) -> int:
        """Validate the samples; return their number of loss tokens."""
        if not samples:
            raise ValueError("train_step needs at least one sample (on every rank)")
        tokens = 0
        for i, s in enumerate(samples):
            t = len(s.token_ids)
            if not (len(s.loss_mask) == len(s.behav_logprobs) == len(s.advantages) == t):
                raise ValueError(f"sample {i}: token_ids, loss_mask, behav_logprobs and "
                                 "advantages must have the same length")
            if t and s.loss_mask[0]:
                # Position 0 has no context, hence no logprob: it can never carry loss.
                raise ValueError(f"sample {i}: loss_mask[0] must be 0")
            tokens += sum(1 for m in s.loss_mask if m)
        return tokens

    def _all_reduce(self, values: list[float] | torch.Tensor, op: str) -> list[float]:
        t = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        if self.engine.dp_world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def train_step(self, samples: list[TrainSample], *, clip_low: float,
                   clip_high: float) -> dict[str, float]:
        """One optimizer step over all `samples`; returns metrics as plain floats.

        With several data-parallel ranks every rank calls this with its own shard; the loss is
        the token mean over all ranks' tokens and the metrics are global.
        """
        start = time.perf_counter()
        local_tokens = self._check(samples)
        world = self.engine.dp_world_size
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids), reverse=True)
        mbs = self.micro_batch_size
        chunks = [order[lo:lo + mbs] for lo in range(0, len(order), mbs)]
        # ZeRO-2/3 reduce gradients inside backward, so all ranks must run as many micro-batches;
        # a rank with fewer repeats its last one at weight 0.
        total_tokens, n_chunks = (int(v) for v in (self._all_reduce([local_tokens], "sum")[0],
                                                   self._all_reduce([len(chunks)], "max")[0]))
        if total_tokens == 0:
            # Token-mean over zero tokens is undefined; the caller should have filtered these.
            raise ValueError("train_step got no loss-carrying tokens (every loss_mask is 0)")
        # DeepSpeed averages gradients over ranks; dividing by tokens/world instead of tokens
        # turns that average back into the sum, i.e. the token mean over every rank's tokens.
        normalizer = total_tokens / world
        self.engine.train()
        # Summed on the device and read once at the end: no host sync per micro-batch on GPU.
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        ratio_max = torch.zeros((), dtype=torch.float64, device=self.device)
        for k in range(n_chunks):
            weight = 1.0 if k < len(chunks) else 0.0
            # Only the last backward of the step may finish the gradient reduction.
            self.engine.set_gradient_accumulation_boundary(k == n_chunks - 1)
            batch = self._batch([samples[i] for i in chunks[min(k, len(chunks) - 1)]])
            logits = self.engine(input_ids=batch["ids"], attention_mask=batch["attn"],
                                 use_cache=False).logits
            logp, entropy = sequence_logprobs(logits, batch["ids"])
            loss, stats = ppo_clip_loss(logp, batch["behav"], batch["adv"], batch["mask"],
                                        clip_low=clip_low, clip_high=clip_high,
                                        normalizer=normalizer)
            # Accumulates into the step's gradient; no optimizer update happens here.
            self.engine.backward(loss * weight)
            if weight:  # loss, entropy, clipped tokens, ratio, approx kl, sequences
                sums += torch.stack([loss.detach() / world,
                                     (entropy.detach() * batch["mask"]).sum(),
                                     stats["clipped_tokens"], stats["ratio_sum"],
                                     stats["approx_kl_sum"], stats["tokens"].new_tensor(
                                         float(len(batch["ids"])))]).double()
                ratio_max = torch.maximum(ratio_max, stats["ratio_max"].double())
            del logits, logp, entropy, loss  # free activations before the next micro-batch
        local_norm = self._local_grad_norm()
        self.engine.step()  # the one boundary: reduce, clip, AdamW update, zero the grads
        loss_sum, entropy_sum, clipped, ratio_sum, kl_sum, sequences = self._all_reduce(sums, "sum")
        return {
            "loss": loss_sum,
            "grad_norm": self._grad_norm(local_norm),
            "entropy": entropy_sum / total_tokens,
            "clip_frac": clipped / total_tokens,
            "approx_kl": kl_sum / total_tokens,
            "ratio_mean": ratio_sum / total_tokens,
            "ratio_max": self._all_reduce([ratio_max], "max")[0],
            "tokens": float(total_tokens),
            "sequences": sequences,
            "step_time_s": time.perf_counter() - start,
        }

    def _local_grad_norm(self) -> float:
        # ZeRO-0 with a torch optimizer clips inside step() but keeps no norm, so we measure it
        # first. With one rank the local gradient is the global one; with more it is not reduced
        # yet, and measuring the reduced one would cost an extra all-reduce: report NaN instead.
        if self.engine.zero_optimization_stage() != 0 or self.engine.dp_world_size != 1:
            return math.nan
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                            for g in grads]))) if grads else 0.0

    def _grad_norm(self, local_norm: float) -> float:
        # Global gradient norm before clipping, as ZeRO 1-3 measured it inside step().
        norm = self.engine.get_global_grad_norm()
        return local_norm if norm is None else float(norm)

    # ---------------------------------------------------------------- weights out

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, with its Hugging Face name, in module order.

        Yields detached copies on CPU, so a consumer may keep them across later steps. Under
        ZeRO-3 each parameter is gathered in turn (memory stays one tensor above the shard):
        every rank must iterate this generator to the end, since gathering is collective.
        """
        for name, param in self.engine.module.named_parameters():
            with self._gathered(param) if self._zero3 else nullcontext():
                yield name, param.detach().to("cpu", copy=True)

    @staticmethod
    def _gathered(param: torch.nn.Parameter) -> Any:
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=None)

    def save_pretrained(self, out_dir: str) -> None:
        """Write a Hugging Face model directory (weights, configs, tokenizer) loadable by
        transformers and vLLM. Collective under ZeRO-3: call on every rank; rank 0 writes."""
        from safetensors.torch import save_file

        weights = {name: t.contiguous() for name, t in self.named_weights()}
        if dist.get_rank() != 0:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        module = self.engine.module
        config = module.config
        saved = (config.use_cache, config.dtype)
        # Inference wants its KV cache back; and say the dtype the weights really have (bf16 runs).
        config.use_cache, config.dtype = True, next(iter(weights.values())).dtype
        try:
            config.save_pretrained(out)
        finally:
            config.use_cache, config.dtype = saved
        if module.generation_config is not None:
            module.generation_config.save_pretrained(out)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        for name in _TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copyfile(self.model_dir / name, out / name)

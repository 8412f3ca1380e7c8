"""One optimizer step: advantages, samples, loss, under DeepSpeed.

advantages.py  group-relative advantage estimators (GRPO, Dr.GRPO, ...), pure Python
batching.py    training samples: one per context of a trajectory, checks, padding
loss.py        per-token log-probabilities and the RL loss (torch)
trainer.py     one optimizer step over a batch of groups, under a DeepSpeed engine
plan.py        a step's micro-batches, the counts that normalise its loss, its metrics
dssetup.py     DeepSpeed set-up: accelerator, process group, engine config
lora.py        LoRA adapters with peft; the actor still gets merged weights
"""

"""The learner role: turns finished episodes into policy updates and broadcasts the new weights.

Layout (import the module you need; this file imports nothing, so `import millstream.learner`
stays cheap):

    replay      staleness-bounded buffer of GRPO groups, with exact episode accounting
    advantages  group-relative advantage estimators (GRPO, Dr.GRPO, ...), pure Python
    batching    training samples: one per context of a trajectory, checks, padding
    loss        per-token log-probabilities and the PPO clip loss (torch)
    trainer     one optimizer step over a batch of groups (micro-batches, metrics)
    dssetup     DeepSpeed set-up: accelerator, process group, engine config
    hfexport    the policy as a Hugging Face model directory
    checkpoint  resumable checkpoints (engine, buffer, RNG states)
    weights     flattening and broadcasting weights to the actor replicas (one group)
    fleet       the run's replicas: which hold the current weights, joins, losses, restarts
    team        several ranks, one voice (rank 0 leads)
    stats       per-step statistics, the collapse and no-signal warnings
    experience  rank 0's sockets to the envpool, and its progress lines
    main        the role's process: receive experience, train, publish versions
"""

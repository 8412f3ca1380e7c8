"""The learner role: turns finished episodes into policy updates and broadcasts the new weights.

Layout (import the module you need; this file imports nothing, so `import learner` stays cheap):

    replay      staleness-bounded buffer of GRPO groups, with exact episode accounting
    advantages  group-relative advantage estimators (GRPO, Dr.GRPO, ...), pure Python
    loss        per-token log-probabilities and the PPO clip loss (torch)
    trainer     one optimizer step over a batch of groups (micro-batches, metrics)
    weights     flattening and broadcasting weights to the actor
    main        the role's process: receive experience, train, publish versions
"""

"""The learner role: turns finished episodes into policy updates and broadcasts the new weights.

Layout (import the module you need; this file imports nothing, so `import millstream.learner`
stays cheap):

    main        the role's process: build the trainer and the ranks, run the loop, exit status
    loop/       rank 0's loop as named steps: receive, step, report, save and resume, finish
    replay      staleness-bounded buffer of GRPO groups, with exact episode accounting
    groups      what the buffer holds: complete and waiting groups, a trajectory's staleness
    episodes/   arriving episodes: sockets, checks, the worker ledger, records, the accounts
    train/      one optimizer step: advantages, samples, loss, the DeepSpeed trainer, LoRA
    sync/       weights to the actor replicas: the broadcast, the fleet of replicas
    persist/    what goes to disk: checkpoints, the replay buffer's state, Hugging Face export
    team        several ranks, one voice (rank 0 leads)
    follower    ranks > 0: enter each collective step rank 0 announces
    stats       per-step statistics, the collapse and no-signal warnings
    evals       evaluation rounds: metrics, never trained
"""

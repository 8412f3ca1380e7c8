"""envpool: thousands of environment episodes as tasks on one event loop (trio by default).

Layout:

    worker.py    the worker process: admission, concurrency, reporting to the learner
    episode.py   one episode: reset, generate, step, ... -> Trajectory or EpisodeFailed
    record.py    the token record of an episode (text, agent and debug episodes alike)
    deadlines.py the timer wheel that keeps the turns', env calls' and episodes' time limits
    gate.py      the staleness-bounded admission gate
    seeds.py     where every random choice of an episode comes from
    stats.py     what a worker counts
    outbox.py    everything for the learner, sent in order by one task (results numbered so)
    redelivery.py what the worker pushed, kept until a learner checkpoint holds it
    lineage.py   what each process announced, in a file its successor names to the learner
    preflight.py `millstream envpool --check`: a config's envpool side, before a run starts
    chat/        token-in/token-out chat context (the envpool owns tokenization)
    envs/        environments (text in, text out) by kind, and their registry
    actors/      the link to the actor replicas: client, router, sampling and retries
    agents/      the OpenAI-compatible endpoint per episode, for agent environments
    scoring/     rewards, the LLM judge, evaluation rounds
    debug/       `millstream debug`: one episode under a GDB-like prompt

Import the module you need; this file imports nothing, so importing one module of the package
does not load the worker. This package never imports torch or vllm: it talks to the actor and
the learner only through `shared.wire` messages.
"""

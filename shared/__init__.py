"""shared: what every role needs and no role owns. Imports nothing from actor/learner/envpool.

Two sides, in rooms that say which is which (tests/test_packaging.py checks the rule):

The roles' library, which actor, learner and envpool import:

    wire/      the messages, their codec, the ZeroMQ transport, CURVE keys, the weight group
    config/    the run configuration: every key with its type, range and meaning; loading it
    obs/       metrics as JSON lines, dashboards, rate-limited logging of bad input
    store/     the trajectory store (SQLite) and the run directory
    process/   start-up and exit of a role process, supervision of a run's processes
    models/    the tiny random Qwen2 model and tokenizer, built locally from a seed

The operator's side, which no role (and nothing of the library) imports:

    launch/    the `millstream` command, `millstream run`, healing, the Ray launcher
    inspect/   `millstream inspect` and `millstream plot`: reading a run

Import the module you need; this file imports nothing, so `import millstream.shared` stays
cheap (torch is imported only by `wire.weightsync` and, lazily, `models.tiny`).
"""

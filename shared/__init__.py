"""shared: what every role needs and no role owns. Imports nothing from actor/learner/envpool.

Layout:
- `protocol.py`   the wire: msgspec messages, the frame codec, group numbering, admission limit;
- `transport.py`  ZeroMQ sockets driven from anyio (trio or asyncio), bounded and observable;
- `config.py`     the run configuration (TOML + dotted overrides, every field documented);
- `weightsync.py` how learner and actor form the weight-broadcast group (gloo / NCCL);
- `tinymodel.py`  the tiny random Qwen2 model and tokenizer, built locally from a seed;
- `metrics.py`    JSON-lines metrics;
- `runtime.py`    start-up chores of every role process;
- `launcher.py`   `millstream run`: starts and supervises the roles;
- `cli.py`        the `millstream` command.

Import the module you need; this file imports nothing, so `import shared` stays cheap (torch is
only imported by `weightsync` and, lazily, `tinymodel`).
"""

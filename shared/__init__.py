"""shared: what every role needs and no role owns. Imports nothing from actor/learner/envpool.

Layout:
- `protocol.py`   the wire: msgspec messages, the frame codec, group numbering, admission limit;
- `causes.py`     why something ended without a result (enums; re-exported by protocol);
- `transport.py`  ZeroMQ sockets driven from anyio (trio or asyncio), bounded and observable;
- `config_schema.py` every config key, its type, range and documentation;
- `config.py`     loading it: TOML + dotted overrides, strict checks that name the key;
- `weightsync.py` how learner and actor form the weight-broadcast group (gloo / NCCL);
- `tinymodel.py`  the tiny random Qwen2 model and tokenizer, built locally from a seed;
- `metrics.py`    JSON-lines metrics;
- `runtime.py`    start-up and exit chores of every role process;
- `lifecycle.py`  how processes end: signals, a dead launcher, leftover children;
- `rundir.py`     the run directory: layout, checkpoints, what a resume may change;
- `supervisor.py` the processes of one run: start, watch, explain an exit, stop;
- `launcher.py`   `millstream run`: checks everything, then starts and supervises the roles;
- `raylaunch.py`  `launcher.kind = "ray"`: the supervisor whose roles are Ray actors' processes,
  with `raycluster.py` (joining the cluster, where roles may go) and `rayhost.py` (on each node);
- `cli.py`        the `millstream` command.

Import the module you need; this file imports nothing, so `import millstream.shared` stays cheap (torch is
only imported by `weightsync` and, lazily, `tinymodel`).
"""

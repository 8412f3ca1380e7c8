"""The config sections about how the run's processes talk and are placed: the transport
(`[transport]`: sockets, CURVE, queues), fault injection (`[chaos]`) and the launcher (`[launcher]`:
local processes or Ray actors). Apart from shared/config/schema.py only to keep each module
readable; the same rules hold (one doc line per field, ranges and choices in the types).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from millstream.shared.config.meta import doc as _doc

__all__ = ["TransportConfig", "ChaosConfig", "LauncherConfig"]


class TransportConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    send_queue: Annotated[int, _doc("Bound of each socket's outbound message queue.", ge=1)] = 65536
    coalesce_max: Annotated[int, _doc("Most messages packed into one frame.", ge=1)] = 512
    max_frame_bytes: Annotated[
        int,
        _doc(
            "Largest frame any socket of the run accepts, before or after authentication (ZeroMQ's "
            "MAXMSGSIZE: a bigger one closes that connection, unread); senders split their batches "
            "to fit. 0: derived from the config (the largest legitimate message, a trajectory of "
            "actor.max_model_len tokens per turn, with room to spare; at least 16 MiB).",
            ge=0,
        ),
    ] = 0
    handshake_timeout_s: Annotated[
        float,
        _doc("A connection that has not finished its handshake (CURVE) by then is closed.", gt=0),
    ] = 10.0
    high_water_mark: Annotated[int, _doc("ZeroMQ send/receive high-water mark, frames.", ge=1)] = 100_000
    io_wait_s: Annotated[
        float, _doc("Longest idle wait on a socket before re-checking (missed-edge guard).", gt=0)
    ] = 0.05
    curve: Annotated[
        bool,
        _doc(
            "Encrypt and authenticate every socket with CURVE keys of the run (shared/wire/keys.py). "
            "false is allowed only when every address is loopback or ipc."
        ),
    ] = True
    keys_dir: Annotated[
        str,
        _doc(
            "Folder of the run's CURVE keys (created if missing, mode 0700). Empty: "
            "`<run.dir>/keys`. A role started by hand for a run points here."
        ),
    ] = ""


class ChaosConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    kill_every_s: Annotated[
        float,
        _doc(
            "Fault injection: the launcher kills (SIGKILL) one random role of `roles` every this "
            "many seconds (0: never). The run must heal (run.max_restarts); these kills do not "
            "use up restarts.",
            ge=0,
        ),
    ] = 0.0
    roles: Annotated[
        list[Literal["actor", "envpool", "learner"]],
        _doc(
            "Roles chaos may kill (each envpool worker and each actor replica is one; the learner "
            "once it has a checkpoint)."
        ),
    ] = msgspec.field(default_factory=lambda: ["actor", "envpool", "learner"])
    seed: Annotated[int, _doc("Seed of which role is killed when.")] = 0


class LauncherConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the roles run: child processes of the launcher, or Ray actors on a Ray cluster
    (shared/launch/ray/launch.py; docs/multihost.md). Ray only places and supervises the processes: the
    data path is ZeroMQ and gloo/NCCL either way, at the addresses configured above."""

    kind: Annotated[
        Literal["local", "ray"],
        _doc(
            "local: every role is a child process of the launcher, on this host; ray: every role "
            "is a process started by a Ray actor on a Ray cluster that is already running."
        ),
    ] = "local"
    ray_address: Annotated[
        str,
        _doc(
            "kind = ray: the cluster's head, HOST:PORT as `ray start --head` printed it, or 'auto' "
            "(RAY_ADDRESS, else the cluster started on this host). The launcher never starts a "
            "cluster; none reachable is an error before any role starts."
        ),
    ] = "auto"
    # Ray CPUs are a reservation for placement, not a limit. The defaults reserve 1.75 CPUs for
    # the default job (one actor, one learner, one envpool worker), so it fits a 2-CPU node.
    actor_cpus: Annotated[
        float,
        _doc(
            "kind = ray: CPUs reserved for each actor process (fractions allowed; Ray sets the "
            "role's OMP_NUM_THREADS to it, at least 1).",
            gt=0,
        ),
    ] = 1.0
    actor_gpus: Annotated[
        float, _doc("kind = ray: GPUs reserved for each actor process (Ray sets CUDA_VISIBLE_DEVICES).", ge=0)
    ] = 0.0
    learner_cpus: Annotated[float, _doc("kind = ray: CPUs reserved for each learner rank.", gt=0)] = 0.5
    learner_gpus: Annotated[
        float, _doc("kind = ray: GPUs reserved for each learner rank (1 per rank on GPU).", ge=0)
    ] = 0.0
    envpool_cpus: Annotated[
        float, _doc("kind = ray: CPUs reserved for each envpool worker process.", gt=0)
    ] = 0.25
    placement_strategy: Annotated[
        Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        _doc(
            "kind = ray: how the run's placement group spreads its bundles (one per role process) "
            "over nodes: PACK fills few nodes, SPREAD many; STRICT_ variants fail rather than bend."
        ),
    ] = "PACK"
    ray_start_timeout_s: Annotated[
        float,
        _doc(
            "kind = ray: longest wait to connect to the cluster, to reserve the run's placement "
            "group, and for each role's Ray actor to start.",
            gt=0,
        ),
    ] = 60.0

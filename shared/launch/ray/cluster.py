"""Joining the Ray cluster of a `launcher.kind = "ray"` run, and where its roles may go.

`connect` makes the launcher the cluster's driver (`ray.init`), bounded in time: an address that
answers but is no Ray head would have `ray.init` retry for good. No cluster is one line naming
`launcher.ray_address` and how to start one; the launcher never starts a cluster.

Ray swaps a loopback address for the host's network address unless Ray's single-host switch
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set (named for the platforms where it is the default);
`connect` sets it for the launcher when `launcher.ray_address` is loopback, before importing ray,
which reads it once. A loopback cluster is started with it too (docs/multihost.md).

`node_pins` says which node each kind of role must run on, from the addresses it binds: a role
binds exactly what the config says, so while any address is loopback (the default) every role
runs on the launcher's node; otherwise each actor replica runs on the node whose IP its address
names (`actor.replica_addresses`), and the learner on `learner.experience_address`'s; envpool
workers go where they fit.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading

from millstream.shared.config import Config, ConfigError
from millstream.shared.wire.replicas import replica_addresses, replica_name

__all__ = ["connect", "node_pins", "check_cluster", "first_line", "LOOPBACK_SWITCH"]

#: Ray's switch for a cluster that lives on loopback only (read once, when ray is imported).
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

log = logging.getLogger("launcher")


def connect(cfg: Config) -> None:
    """Join the cluster at `launcher.ray_address` as its driver; ConfigError if none answers."""
    address = cfg.launcher.ray_address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or address
    if address != "auto":
        host, port = _host_port(address)
        _reachable(host, port, min(5.0, cfg.launcher.ray_start_timeout_s))
        if _is_loopback(host):
            os.environ.setdefault(LOOPBACK_SWITCH, "0")  # else Ray swaps 127.0.0.1 for this host's IP
    _init(address, cfg.launcher.ray_start_timeout_s)


def _init(address: str, timeout_s: float) -> None:
    """`ray.init`, bounded: it retries an address that is not a Ray head for good, so it runs in a
    thread of its own, left behind (a daemon) if it does not connect in time."""
    import ray

    if ray.is_initialized():
        return
    failed: list[Exception] = []

    def init() -> None:
        try:
            # Ray's errors only (not "SIGTERM handler is not set": the launcher sets its own).
            ray.init(
                address=address, namespace="millstream", log_to_driver=False, logging_level=logging.ERROR
            )
        except Exception as exc:  # raised below, in the launcher's thread
            failed.append(exc)

    thread = threading.Thread(target=init, name="millstream-ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ConfigError(
            f"launcher.ray_address = {address!r}: no Ray cluster answered in {timeout_s:.0f}s "
            f"(launcher.ray_start_timeout_s); {_START_HINT}"
        )
    if failed:
        raise ConfigError(f"launcher.ray_address = {address!r}: {first_line(failed[0])}; {_START_HINT}")


def node_pins(cfg: Config, here: str) -> dict[str, str | None]:
    """The node IP each kind of role must run on (None: anywhere), from the addresses it binds.
    `here` is the launcher's node."""
    hosts = {
        "actor.address": _host_of(cfg.actor.address) if not cfg.actor.connect else None,
        "actor.connect": _host_of(cfg.actor.connect) if cfg.actor.connect else None,
        "learner.experience_address": _host_of(cfg.learner.experience_address),
        "learner.version_address": _host_of(cfg.learner.version_address),
        "learner.sync_host": cfg.learner.sync_host,
    }
    replicas = {} if cfg.actor.connect else dict(enumerate(replica_addresses(cfg)))
    for i, address in replicas.items():
        hosts[f"actor.replica_addresses[{i}]"] = _host_of(address)
    judge = cfg.judge.model_path and not cfg.judge.connect
    if judge:
        hosts["judge.address"] = _host_of(cfg.judge.address)
    if any(h is not None and _is_loopback(h) for h in hosts.values()):
        return {"actor": here, "learner": here, "envpool": here, **({"judge": here} if judge else {})}
    return {
        # The judge (one more engine) runs on the node of the address it binds.
        **({"judge": _node_ip(hosts["judge.address"])} if judge else {}),
        "actor": _node_ip(hosts["actor.address"]),
        "learner": _node_ip(hosts["learner.experience_address"]),
        "envpool": None,
        # Each replica runs on the node of the address it binds (actor.replica_addresses).
        **{replica_name(i): _node_ip(_host_of(a)) for i, a in replicas.items()},
    }


def check_cluster(cfg: Config) -> None:
    """Before anything starts: the cluster answers, and holds a node for every pinned role."""
    connect(cfg)
    import ray

    alive = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    for kind, ip in node_pins(cfg, ray.util.get_node_ip_address()).items():
        if ip is not None and ip not in alive:
            raise ConfigError(
                f"launcher.kind = 'ray': the {kind} binds an address of {ip}, which is no node of the "
                f"Ray cluster (nodes: {', '.join(sorted(alive))}); a role binds its address on the "
                "node it runs on"
            )
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and cfg.actor.kind == "vllm" and cfg.actor.device != "cpu" and not cfg.launcher.actor_gpus:
        log.warning(
            "the Ray cluster has %d GPUs but launcher.actor_gpus = 0: Ray hides them from the "
            "actor, whose engine then runs on the CPU; give the roles GPUs with "
            "launcher.actor_gpus and launcher.learner_gpus",
            gpus,
        )


_START_HINT = (
    "start a cluster first, e.g. `ray start --head --node-ip-address 127.0.0.1` (docs/multihost.md); "
    "the launcher never starts one"
)


def _reachable(host: str, port: int, timeout_s: float) -> None:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"launcher.ray_address = '{host}:{port}': no Ray cluster answers there "
            f"({exc.strerror or exc}); {_START_HINT}"
        ) from None


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _host_of(address: str) -> str:
    """The host of a tcp:// address; ipc:// (a path on one host) counts as loopback."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    return address[len("tcp://") :].rpartition(":")[0].strip("[]")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _node_ip(host: str | None) -> str | None:
    """The IP a role binding `host` must run at; None for a wildcard (any node will do)."""
    if host is None or host in ("*", "0.0.0.0", "::"):
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(f"launcher.kind = 'ray': host {host!r} of a role's address: {exc}") from None


def first_line(exc: BaseException) -> str:
    """An exception's first line (Ray's run to pages), at most 300 characters; for an error
    raised inside a Ray actor's method, the original one's."""
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__

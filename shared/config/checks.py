"""Checks that span several keys, run after the types and before any role starts: addresses
(well-formed, loopback without CURVE, one replica one address), the judge's pattern and
rubric, a generation budget that fits the context, a batch that fits the buffer, a run name
that stays inside run.root, and no NaN anywhere. Each problem is one line naming the keys.
"""

from __future__ import annotations

import ipaddress
import math
import re

import msgspec

from millstream.shared.config.learning import filter_pool_size
from millstream.shared.config.meta import ConfigError, show_value
from millstream.shared.config.schema import Config
from millstream.shared.obs.dashboards import backend_problem

__all__ = ["check_config"]

_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+|\*):(\d{1,5})|ipc://.+")


def check_config(cfg: Config) -> None:
    """What types and ranges cannot say alone; raises ConfigError naming the keys."""
    _check_numbers(cfg)
    addresses = {
        "actor.address": cfg.actor.address,
        "actor.connect": cfg.actor.connect,
        "learner.experience_address": cfg.learner.experience_address,
        "learner.version_address": cfg.learner.version_address,
    }
    for i, address in enumerate(cfg.actor.replica_addresses):
        addresses[f"actor.replica_addresses[{i}]"] = address
    if cfg.judge.model_path or cfg.judge.connect:
        addresses["judge.address"], addresses["judge.connect"] = cfg.judge.address, cfg.judge.connect
    for key, address in addresses.items():
        if address or not key.endswith(".connect"):
            _check_address(key, address)
    _check_replicas(cfg)
    _check_judge(cfg)
    if not cfg.transport.curve:
        wide = {k: a for k, a in addresses.items() if a and not _is_local(a)}
        if wide:
            key, address = next(iter(wide.items()))
            raise ConfigError(
                f"transport.curve = false: {key} = {show_value(address)} is not a loopback address; "
                "a socket beyond this machine needs authentication (transport.curve = true)"
            )
    if cfg.envpool.max_tokens >= cfg.actor.max_model_len:
        raise ConfigError(
            f"envpool.max_tokens = {cfg.envpool.max_tokens}: a turn's generation budget must "
            f"leave room for its prompt within actor.max_model_len = {cfg.actor.max_model_len}"
        )
    low, high = cfg.learner.reward_range
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(
            f"learner.reward_range = {cfg.learner.reward_range}: expected [low, high], finite, low < high"
        )
    if cfg.actor.max_messages_per_frame < cfg.transport.coalesce_max:
        raise ConfigError(
            f"actor.max_messages_per_frame = {cfg.actor.max_messages_per_frame}: below "
            f"transport.coalesce_max = {cfg.transport.coalesce_max}, the actor would refuse the "
            "envpool's own frames"
        )
    problem = backend_problem(cfg.metrics.backends)
    if problem:
        raise ConfigError(problem)
    if cfg.launcher.kind == "ray" and cfg.launcher.ray_address != "auto":
        _check_ray_address(cfg.launcher.ray_address)
    if cfg.eval.samples > 1 and cfg.eval.temperature == 0:
        raise ConfigError(
            f"eval.samples = {cfg.eval.samples} with eval.temperature = 0: greedy samples are all "
            "the same; pass@k needs eval.temperature > 0"
        )
    name = cfg.run.name
    if not name or "/" in name or "\x00" in name or name.startswith("."):
        raise ConfigError(
            f"run.name = {name!r}: expected a folder name (not empty, no '/', not starting with "
            "'.'): the run directory is <run.root>/<run.name>-<time>, inside run.root"
        )
    pool = filter_pool_size(cfg.learner, cfg.train.groups_per_batch)  # starpo_s: its candidates
    if pool > cfg.learner.max_buffer_groups:
        raise ConfigError(
            f"train.groups_per_batch = {cfg.train.groups_per_batch}: a batch takes {pool} complete "
            f"groups, more than learner.max_buffer_groups = {cfg.learner.max_buffer_groups} holds, "
            "so no batch could ever form"
        )
    if cfg.train.group_size > cfg.envpool.max_concurrent_episodes:
        raise ConfigError(
            f"train.group_size = {cfg.train.group_size}: exceeds envpool.max_concurrent_episodes "
            f"= {cfg.envpool.max_concurrent_episodes}, so a group could never start"
        )


def _check_judge(cfg: Config) -> None:
    """The judge's score pattern compiles and has a group; its rubric names only known fields."""
    judge = cfg.judge
    if judge.connect and not judge.model_path:
        raise ConfigError(
            f"judge.connect = {judge.connect!r}: also set judge.model_path (the judge's tokenizer "
            "and chat template; the launcher then starts no judge)"
        )
    try:
        groups = re.compile(judge.score_pattern).groups
    except re.error as exc:
        raise ConfigError(
            f"judge.score_pattern = {judge.score_pattern!r}: not a regular expression: {exc}"
        ) from None
    if groups < 1:
        raise ConfigError(f"judge.score_pattern = {judge.score_pattern!r}: needs a group (the score)")
    try:
        judge.rubric.format(task="", response="", transcript="")
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ConfigError(
            f"judge.rubric: {type(exc).__name__} {exc}; the fields are {{task}}, {{response}}, "
            "{transcript} (double other braces: {{ }})"
        ) from None


def _check_replicas(cfg: Config) -> None:
    listed = cfg.actor.replica_addresses
    if listed and len(listed) != cfg.actor.replicas:
        raise ConfigError(
            f"actor.replica_addresses lists {len(listed)} addresses for actor.replicas = "
            f"{cfg.actor.replicas}: one per replica (or none: the launcher fills them in)"
        )
    if len(set(listed)) != len(listed):
        raise ConfigError(f"actor.replica_addresses = {listed}: two replicas cannot bind one address")
    if cfg.actor.connect and cfg.actor.replicas > 1:
        raise ConfigError(
            f"actor.replicas = {cfg.actor.replicas} with actor.connect set: the launcher starts no "
            "actor then; more replicas join a run with `millstream actor --join`"
        )


def _is_local(address: str) -> bool:
    """ipc, inproc, or tcp on a loopback host."""
    match = _ADDRESS.fullmatch(address)
    if match is None or not address.startswith("tcp://"):
        return address.startswith(("ipc://", "inproc://"))
    host = match.group(1).strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


def _check_ray_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) <= 65535):
        raise ConfigError(
            f"launcher.ray_address = {show_value(address)}: expected HOST:PORT of the Ray head "
            "(as `ray start --head` printed it) or 'auto'"
        )


def _check_address(key: str, address: str) -> None:
    match = _ADDRESS.fullmatch(address)
    port = match.group(2) if match else None
    if match is None or (port is not None and int(port) > 65535):
        raise ConfigError(
            f"{key} = {show_value(address)}: expected tcp://HOST:PORT (port 0 picks a free one) or ipc://PATH"
        )


# --- writing and describing --------------------------------------------------------------------


def _check_numbers(cfg: Config) -> None:
    """No setting is NaN: it passes every range check (each comparison is False) and then makes
    every number it touches NaN (a judge weight of NaN, every judged reward)."""
    for section, values in msgspec.structs.asdict(cfg).items():
        for key, value in msgspec.structs.asdict(values).items():
            if isinstance(value, float) and math.isnan(value):
                raise ConfigError(f"{section}.{key} = nan: expected a number")


# --- errors that name the key ------------------------------------------------------------------

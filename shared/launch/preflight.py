"""What `millstream run` checks before any role starts, beyond the config's own checks.

Each check here stands for a failure that would otherwise show only after engines load (a minute
or more on a CPU) and that no restart can mend: a run directory that holds another run, a tensor
parallel size the model cannot split into, an address another process already listens on, an
environment or a LoRA target the roles would refuse. A problem is a ConfigError naming the key;
the launcher prints it as one line and makes no run directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from millstream.shared.config import Config, ConfigError, dump_config
from millstream.shared.config.trainable import sampling_problem
from millstream.shared.process.allocator import check_allocator
from millstream.shared.process.cpus import check_cpus
from millstream.shared.process.gpus import check_gpus, gpu_plan, shared_gpus, weights_share_gpu
from millstream.shared.process.lifecycle import run_processes
from millstream.shared.process.runtime import bind_problem, check_tensor_parallel

__all__ = ["check_actor", "check_bind_addresses", "check_roles", "check_run_dir", "bind_addresses"]

log = logging.getLogger("launcher")


def check_run_dir(run_dir: Path, resuming: bool) -> None:
    """A run directory holds one run: never a live one, and never a second one by accident."""
    live = run_processes(run_dir)
    if live:
        raise ConfigError(
            f"run.dir = {str(run_dir)!r}: a run is still live in it (pids "
            f"{', '.join(map(str, live))}); stop it first"
        )
    if not resuming and (run_dir / "config.toml").exists():
        raise ConfigError(
            f"run.dir = {str(run_dir)!r}: already holds a run; resume it with "
            f"run.resume={run_dir}, or choose another run.dir"
        )


def check_actor(cfg: Config) -> None:
    """What the actor this run starts would refuse only after its engine's processes started;
    core lists (`*.cpus`) naming cores this machine does not offer, GPU lists (`*.gpus`) it
    cannot honour; an allocator library that is not there."""
    if not cfg.actor.connect and cfg.actor.kind == "vllm":
        check_tensor_parallel(cfg.model.path, cfg.actor.tensor_parallel_size)
        _check_context(cfg)
    if cfg.launcher.kind == "local":  # on Ray the roles' hosts may have other cores and files
        check_cpus(cfg)
        check_gpus(cfg)
        check_allocator(cfg)
        _check_shared_gpus(cfg)


def _check_context(cfg: Config) -> None:
    """`actor.max_model_len` within the model's own context (config.json's
    max_position_embeddings): vLLM refuses a longer one only as its engine starts, unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN says to go past it."""
    if not cfg.model.path or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        return
    try:
        config = orjson.loads((Path(cfg.model.path).expanduser() / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return  # check_model_dir and vLLM say what is wrong with the directory
    longest = config.get("text_config", config).get("max_position_embeddings")
    if isinstance(longest, int) and cfg.actor.max_model_len > longest:
        raise ConfigError(
            f"actor.max_model_len = {cfg.actor.max_model_len}: more than the model's context "
            f"({longest} tokens, max_position_embeddings in {cfg.model.path}/config.json)"
        )


def _check_shared_gpus(cfg: Config) -> None:
    """Where two GPU processes share a GPU (too few for one each, or lists that overlap): legal
    (one GPU for all), but the user should know what it costs, and an explicit NCCL weight group
    that cannot form is refused here rather than after the engines loaded."""
    crossing = weights_share_gpu(cfg)
    if crossing is not None and cfg.learner.sync_backend == "nccl":
        raise ConfigError(
            f"learner.sync_backend = 'nccl': the learner and an actor replica would both compute "
            f"on GPU {crossing}, which NCCL cannot connect; give them GPUs of their own "
            "(actor.gpus, learner.gpus) or leave the backend to 'auto' (gloo, then)"
        )
    shared = shared_gpus(cfg)
    if shared:
        log.warning(
            "GPU %s will hold two or more of the run's GPU processes (%s): each engine (a judge "
            "too) takes actor.gpu_memory_utilization of it, the learner what is left%s",
            ", ".join(shared),
            gpu_plan(cfg),
            "; the weights go over gloo (NCCL cannot connect two processes on one GPU)" if crossing else "",
        )


def bind_addresses(cfg: Config) -> list[tuple[str, str]]:
    """(config key, address) for every address a role this launcher starts will bind, on the
    resolved config (ports filled in)."""
    out = [
        ("learner.experience_address", cfg.learner.experience_address),
        ("learner.version_address", cfg.learner.version_address),
    ]
    if not cfg.actor.connect:
        for i, address in enumerate(cfg.actor.replica_addresses or [cfg.actor.address]):
            out.append(
                (
                    "actor.address" if address == cfg.actor.address else f"actor.replica_addresses[{i}]",
                    address,
                )
            )
    if cfg.judge.model_path and not cfg.judge.connect:
        out.append(("judge.address", cfg.judge.address))
    return out


def check_bind_addresses(cfg: Config) -> None:
    """Every address the run's roles will bind is their own and (TCP) free now. A busy one would fail the role
    at its bind, after its engine loaded, and again at every restart (a bind error never mends);
    here it fails in well under a second, naming the key. Only for roles on this host: with
    `launcher.kind = "ray"` the roles bind on the hosts Ray places them on."""
    if cfg.launcher.kind != "local":
        return
    taken: dict[str, str] = {}  # two roles on one address: the second fails at its bind
    for key, address in bind_addresses(cfg):
        if address.endswith(":0"):
            continue
        same = address.replace("//localhost:", "//127.0.0.1:")
        if same in taken:
            raise ConfigError(f"{key} = {address!r}: {taken[same]} binds it too; each role needs its own")
        taken[same] = key
        if not address.startswith("tcp://"):
            continue
        host, port = address[len("tcp://") :].rsplit(":", 1)
        problem = bind_problem(host.strip("[]"), int(port))
        if problem:
            raise ConfigError(f"{key} = {address!r}: {problem}; choose another port, or port 0 (a free one)")


def check_sampling(cfg: Config) -> None:
    """Sampling the learner could not train on (shared/config/trainable.py)."""
    problem = sampling_problem(cfg)
    if problem:
        raise ConfigError(problem)


def check_roles(cfg: Config) -> None:
    """`millstream envpool --check` on the resolved config, and `millstream learner --check`
    where the learner has something to check before it starts (LoRA targets)."""
    _check_role("envpool", cfg, max(120.0, cfg.envpool.step_timeout_s + 60))
    if cfg.learner.lora_rank > 0:
        _check_role("learner", cfg, 120.0)


def _check_role(role: str, cfg: Config, timeout_s: float) -> None:
    """A role's own checks on the resolved config, in a child process because the launcher
    imports no role. The problem, if any, is its one line on stdout (its logs go to stderr);
    its warnings (a sandbox without a cgroup, a template that re-renders) are passed on."""
    with tempfile.TemporaryDirectory(prefix="millstream-check-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(dump_config(cfg))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", f"millstream.{role}", "--check", "--config", str(path)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(f"the {role}'s check did not finish in {timeout_s:.0f}s") from None
    if proc.returncode == 2 and proc.stdout.strip():
        raise ConfigError(proc.stdout.strip().splitlines()[0])
    if proc.returncode != 0:
        raise ConfigError(f"the {role}'s check failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    for line in proc.stderr.splitlines():
        _, warning, said = line.partition(f" {role} WARNING ")
        if warning:  # "<logger>: <message>": the message
            log.warning("%s's check: %s", role, said.partition(": ")[2] or said)

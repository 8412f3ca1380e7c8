"""The run directory: its layout, where a resume continues, and what a resume may change.

    runs/<name>-<time>/
        config.toml          the resolved config of the latest session (an earlier session's is
                             kept as config-before-step-N.toml when a resume replaces it)
        logs/<name>.log      each process's output; <name>.exit.json: why it failed, if it did
        metrics.jsonl        one record per step, events, the summary; rolled-back ones marked
        store.sqlite         the trajectory store: every trained, dropped and failed episode with
                             its turns (shared/store/trajstore.py; `millstream inspect` reads it)
        trajectories.jsonl   with store.jsonl = true: a line per trained or failed episode
        envpool-w<i>.jsonl   each envpool worker's statistics
        summary.json         the final accounting
        checkpoints/latest   the name of the newest complete checkpoint (step_NNNNNN/)

A resume (`run.resume=<run dir or checkpoint>`) continues **in the same run directory** from a
checkpoint at step N. Each checkpoint records how far `metrics.jsonl`, the store (its last row
id) and `trajectories.jsonl` had been written when it was saved (`records`, in the learner's
state). The records after those positions are what the resumed session replaces: they are not
deleted (they are what happened) but marked rolled back (`"rolled_back": true`, the store's
`rolled_back` column) before anything starts, so reading them never double counts.
Checkpoints of the abandoned timeline (steps above N) are moved aside to
`checkpoints/rolled-back-step_NNNNNN`, so `latest` and a later resume never pick them.

What a resume may change is decided before anything starts (`resume_conflicts`): keys that
define the policy, the task or the algorithm must match the checkpoint's run (a changed
environment, learning rate or staleness bound would silently train a different experiment);
other keys (train.steps, timeouts, micro-batch size, logging, ...) may change and are reported.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
import orjson

from millstream.shared.config import Config, ConfigError, load_config
from millstream.shared.store.trajstore import STORE_FILE, mark_rolled_back_after

__all__ = [
    "STATE_FILE",
    "find_checkpoint",
    "step_dirs",
    "checkpoint_step",
    "Resume",
    "plan_resume",
    "resume_conflicts",
    "mark_rolled_back",
    "checkpoint_records",
    "retire_later_checkpoints",
    "MUST_MATCH",
]

log = logging.getLogger(__name__)

#: The learner's state file inside a checkpoint folder (learner/persist/checkpoint.py writes it).
STATE_FILE = "learner_state.msgpack"

#: Keys (or whole sections, or section prefixes) a resumed run must share with its checkpoint.
MUST_MATCH = (
    "model.path",
    "model.tiny_seed",
    "model.dtype",
    "train.group_size",
    "train.groups_per_batch",
    "train.max_staleness",
    "envpool.env",
    "envpool.env_args",
    "envpool.max_turns",
    "envpool.max_tokens",
    "envpool.temperature",
    "envpool.top_p",
    "envpool.admission_slack",
    "learner.lr",
    "learner.weight_decay",
    "learner.adam_beta1",
    "learner.adam_beta2",
    "learner.adam_eps",
    "learner.grad_clip",
    "learner.clip_low",
    "learner.clip_high",
    "learner.train_dtype",
    "learner.advantage",
    "learner.reward_level",
    "learner.gamma",
    "learner.gigpo_step_weight",
    "learner.ngrpo_max_reward",
    "learner.group_filter",
    "learner.starpo_keep",
    "learner.loss_agg",
    "learner.staleness_policy",
    "learner.decoupled_max_staleness",
    "learner.is_cap",
    "learner.kl_coef",
    "learner.kl_estimator",
    "learner.entropy_coef",
    "learner.lora_rank",  # the adapters' shapes and scale are the checkpoint's own
    "learner.lora_alpha",
    "learner.lora_dropout",
    "learner.lora_target_modules",
    "learner.ranks",
    "learner.zero_stage",
    "run.seed",
)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `root` (a `checkpoints` folder), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / STATE_FILE).is_file():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder given itself, a run directory (its `checkpoints/latest`) or a
    `checkpoints` folder; raises FileNotFoundError naming what was looked for."""
    path = Path(path).expanduser()
    if (path / STATE_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "latest"
        if latest.is_file():
            named = root / latest.read_text().strip()
            if (named / STATE_FILE).is_file():
                return named
            # Only a crash while a checkpoint of the same version was replaced leaves it dangling.
            if found := step_dirs(root):
                log.warning("%s names missing %s; using %s", latest, named, found[-1][1])
                return found[-1][1]
    raise FileNotFoundError(
        f"no checkpoint at {path}: looked for {path / STATE_FILE} (a checkpoint folder), "
        f"{path / 'checkpoints' / 'latest'} (a run directory) and {path / 'latest'}"
    )


def checkpoint_step(checkpoint: Path) -> int:
    """The policy version a checkpoint folder holds (its name: step_NNNNNN)."""
    return int(checkpoint.name.removeprefix("step_"))


@dataclass(frozen=True)
class Resume:
    """Where a resumed run continues."""

    checkpoint: Path
    step: int
    run_dir: Path
    #: The resolved config of the session that wrote the checkpoint.
    previous: Config
    #: How far each record file was written at the checkpoint (see `mark_rolled_back`).
    records: dict[str, int]


def plan_resume(where: str) -> Resume:
    """Find the checkpoint and its run's resolved config; ConfigError if either is missing."""
    try:
        checkpoint = find_checkpoint(where)
    except FileNotFoundError as exc:
        raise ConfigError(f"run.resume = {where!r}: {exc}") from None
    if not re.fullmatch(r"step_\d+", checkpoint.name):
        raise ConfigError(
            f"run.resume = {where!r}: {checkpoint.name} is not named as a run names its checkpoints "
            "(step_N): renamed, or moved aside by an earlier resume (rolled-back-step_N)"
        )
    run_dir = checkpoint.parent.parent
    config = run_dir / "config.toml"
    if not config.is_file():
        raise ConfigError(f"run.resume = {where!r}: {checkpoint} is not inside a run directory (no {config})")
    return Resume(
        checkpoint.resolve(),
        checkpoint_step(checkpoint),
        run_dir.resolve(),
        load_config(config),
        checkpoint_records(checkpoint),
    )


#: Keys that belong to one session, not to the run: never compared.
_SESSION_KEYS = frozenset(
    {
        "run.dir",
        "run.resume",
        "actor.address",
        "actor.replica_addresses",
        "learner.experience_address",
        "learner.version_address",
        "judge.address",  # picked afresh at each start, like the other addresses
    }
)


def resume_conflicts(previous: Config, new: Config) -> tuple[list[str], list[str]]:
    """(keys in MUST_MATCH that differ, as `key: old -> new`; other keys that differ)."""
    old, now = _flat(previous), _flat(new)
    refused: list[str] = []
    changed: list[str] = []
    for key in sorted(old.keys() | now.keys()):
        if old.get(key) == now.get(key) or key in _SESSION_KEYS:
            continue
        line = f"{key}: {old.get(key)!r} -> {now.get(key)!r}"
        unused = (
            key.startswith("learner.lora_") and key != "learner.lora_rank" and not old["learner.lora_rank"]
        )
        (refused if key in MUST_MATCH and not unused else changed).append(line)  # no adapters: no scale
    return refused, changed


def _flat(cfg: Config) -> dict[str, Any]:
    out = {}
    for section, values in msgspec.structs.asdict(cfg).items():
        for key, value in msgspec.structs.asdict(values).items():
            out[f"{section}.{key}"] = value
    return out


def checkpoint_records(checkpoint: Path) -> dict[str, int]:
    """How far each record file was written when `checkpoint` was saved ({} if not recorded)."""
    state = msgspec.msgpack.decode((checkpoint / STATE_FILE).read_bytes())
    return dict(state.get("extra", {}).get("records", {}))


def mark_rolled_back(run_dir: Path, records: dict[str, int], step: int | None = None) -> dict[str, int]:
    """Mark every record after `records[name]` bytes of each file rolled back; returns how many
    per file. Streams (constant memory) and replaces each file atomically; a torn last line
    (left by a kill mid-write) is dropped. The checkpoint event of `step` (the checkpoint resumed
    from) is kept: it is written just after the positions its checkpoint records."""
    marked = {}
    for name, offset in records.items():
        path = run_dir / name
        if not path.is_file():
            continue
        if name == STORE_FILE:  # the trajectory store: rows after the checkpoint's last id
            marked[name] = mark_rolled_back_after(path, offset)
            continue
        tmp = path.with_name(f"{name}.tmp")
        count = 0
        with path.open("rb") as src, tmp.open("wb") as dst:
            _copy_prefix(src, dst, offset)
            for line in src:
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                resumed_from = (
                    isinstance(record, dict)
                    and record.get("event") == "checkpoint"
                    and record.get("step") == step
                )
                if isinstance(record, dict) and not record.get("rolled_back") and not resumed_from:
                    record["rolled_back"] = True
                    count += 1
                dst.write(orjson.dumps(record) + b"\n")
        os.replace(tmp, path)
        marked[name] = count
    return marked


def _copy_prefix(src: IO[bytes], dst: IO[bytes], size: int, chunk: int = 1 << 20) -> None:
    left = size
    while left > 0:
        data = src.read(min(chunk, left))
        if not data:
            break
        dst.write(data)
        left -= len(data)


def retire_later_checkpoints(run_dir: Path, step: int) -> list[Path]:
    """Move checkpoints above `step` aside (`rolled-back-step_N`) and point `latest` at `step`."""
    root = run_dir / "checkpoints"
    moved = []
    for number, path in step_dirs(root):
        if number > step:
            target = root / f"rolled-back-{path.name}"
            shutil.rmtree(target, ignore_errors=True)
            path.rename(target)
            moved.append(target)
    tmp = root / "latest.tmp"
    tmp.write_text(f"step_{step:06d}\n")
    os.replace(tmp, root / "latest")
    return moved

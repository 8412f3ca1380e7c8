"""The run directory: its layout, where a resume continues, and what a resume may change.

    runs/<name>-<time>/
        config.toml          the resolved config of the latest session (earlier: config-<k>.toml)
        logs/<name>.log      each process's output; <name>.exit.json: why it failed, if it did
        metrics.jsonl        one record per step, events, the summary; rolled-back ones marked
        trajectories.jsonl   one record per trained or failed episode; rolled-back ones marked
        envpool-w<i>.jsonl   each envpool worker's statistics
        summary.json         the final accounting
        checkpoints/latest   the name of the newest complete checkpoint (step_NNNNNN/)

A resume (`run.resume=<run dir or checkpoint>`) continues **in the same run directory** from a
checkpoint at step N. The records the killed session wrote after N are not deleted (they are
what happened) but marked `"rolled_back": true` before anything starts, so concatenating the
files never double counts: a step's record is rolled back if its step is above N, a trained
episode's if it trained at a step above N, a failed episode's if it arrived while the learner
was at version N or later (the checkpoint of step N is saved before any later arrival).

What a resume may change is decided before anything starts (`resume_conflicts`): keys that
define the policy, the task or the algorithm must match the checkpoint's run (a changed
environment, learning rate or staleness bound would silently train a different experiment);
other keys (train.steps, timeouts, logging, ...) may change and are reported.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import orjson

from .config import Config, ConfigError, load_config

__all__ = [
    "STATE_FILE",
    "find_checkpoint",
    "step_dirs",
    "checkpoint_step",
    "Resume",
    "plan_resume",
    "resume_conflicts",
    "mark_rolled_back",
    "MUST_MATCH",
]

log = logging.getLogger(__name__)

#: The learner's state file inside a checkpoint folder (learner/checkpoint.py writes it).
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
    "learner.micro_batch_size",
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


def plan_resume(where: str) -> Resume:
    """Find the checkpoint and its run's resolved config; ConfigError if either is missing."""
    try:
        checkpoint = find_checkpoint(where)
    except FileNotFoundError as exc:
        raise ConfigError(f"run.resume = {where!r}: {exc}") from None
    run_dir = checkpoint.parent.parent
    config = run_dir / "config.toml"
    if not config.is_file():
        raise ConfigError(f"run.resume = {where!r}: {checkpoint} is not inside a run directory (no {config})")
    return Resume(checkpoint.resolve(), checkpoint_step(checkpoint), run_dir.resolve(), load_config(config))


#: Keys that belong to one session, not to the run: never compared.
_SESSION_KEYS = frozenset(
    {"run.dir", "run.resume", "actor.address", "learner.experience_address", "learner.version_address"}
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
        (refused if key in MUST_MATCH else changed).append(line)
    return refused, changed


def _flat(cfg: Config) -> dict[str, Any]:
    out = {}
    for section, values in msgspec.structs.asdict(cfg).items():
        for key, value in msgspec.structs.asdict(values).items():
            out[f"{section}.{key}"] = value
    return out


def mark_rolled_back(run_dir: Path, step: int) -> dict[str, int]:
    """Mark the records written after the checkpoint at `step` (see the module docstring);
    returns how many were marked per file. Each file is rewritten atomically."""
    marked = {}
    rules = {
        "metrics.jsonl": lambda r: r.get("step", -1) > step,
        "trajectories.jsonl": lambda r: (
            r.get("step", -1) > step if r.get("fate") == "trained" else r.get("version", -1) >= step
        ),
    }
    for name, after in rules.items():
        path = run_dir / name
        if not path.is_file():
            continue
        lines, count = [], 0
        for line in path.read_bytes().splitlines():
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a torn line left by the kill
            if isinstance(record, dict) and not record.get("rolled_back") and after(record):
                record["rolled_back"] = True
                count += 1
            lines.append(orjson.dumps(record))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in lines))
        os.replace(tmp, path)
        marked[name] = count
    return marked

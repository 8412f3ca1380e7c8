"""A dataset of prompts with reference answers, scored by a reward function.

    envpool.env = "dataset"
    envpool.env_args = { path = "data/math.jsonl", prompt_field = "question",
                         answer_field = "answer", reward = "mypkg.rewards:exact" }

`path` is a JSONL file (one JSON object a line), a Parquet file (needs pyarrow: the `data`
extra), or a folder holding `<split>.jsonl` or `<split>.parquet`, of which `split` (default
"train") picks one; `millstream:NAME` names a set shipped in envpool/envs/data/ (the arithmetic
worked example: `millstream:arithmetic`, splits "train" and "eval"). Rows are chosen by seed: seed
`s` plays row `s mod len(rows)`, so the members of a group face the same row and eval seeds 0..N-1
(`[eval]`, envpool/scoring/evaluator.py) walk the first N rows in order.

`reward` is "module:function" with the signature in envpool/scoring/rewards.py (default:
`millstream.envpool.scoring.rewards:math_answer`, boxed or last-number matching). The observation is the
row's prompt; `system_prompt` (optional) opens the chat.

Modes:
- "single": one turn, the episode's reward is the function's;
- "feedback": a wrong answer is answered with `feedback` and the model tries again, up to
  `max_attempts`; the first success ends the episode. Each attempt's reward is its turn reward,
  so the episode's return is the successful attempt's reward (1 for math_answer).

Every problem of the arguments is a ValueError naming the key before a run starts (the
preflight builds this environment): a missing file or field, an unimportable reward function.
Files are read once per process (cached by path, size and modification time; bounded), not per
episode. A reward function that raises or returns a non-number makes `step` raise, which ends
the episode as `env_error`.
"""

from __future__ import annotations

import importlib
import math
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from millstream.envpool.envs.base import Observation, StepResult, register
from millstream.envpool.envs.tasks.attempts import Attempts

__all__ = ["Dataset", "load_rows", "resolve_path", "load_reward", "shipped_sets", "SHIPPED_PREFIX"]

SHIPPED_PREFIX = "millstream:"
_SHIPPED_DIR = Path(__file__).parent.parent / "data"  # envpool/envs/data
#: Distinct files kept in memory per process.
_CACHE_FILES = 8
_cache: OrderedDict[tuple[str, int, int], list[dict[str, Any]]] = OrderedDict()

Reward = Callable[[str, str, dict[str, Any]], Any]


def resolve_path(path: str, split: str) -> Path:
    """The data file that `path` and `split` name; ValueError naming the key if there is none."""
    if not path:
        raise ValueError("envpool.env_args.path is required: a JSONL or Parquet file, or a folder of splits")
    base = _SHIPPED_DIR / path[len(SHIPPED_PREFIX) :] if path.startswith(SHIPPED_PREFIX) else Path(path)
    base = base.expanduser()
    if base.is_dir():
        for suffix in (".jsonl", ".parquet"):
            if (base / f"{split}{suffix}").is_file():
                return base / f"{split}{suffix}"
        raise ValueError(f"envpool.env_args.split = {split!r}: no {split}.jsonl or {split}.parquet in {base}")
    if not base.is_file():
        shipped = f" (shipped: {', '.join(shipped_sets())})" if path.startswith(SHIPPED_PREFIX) else ""
        raise ValueError(f"envpool.env_args.path = {path!r}: no such file or folder ({base}){shipped}")
    if split != "train":
        raise ValueError(
            f"envpool.env_args.split = {split!r}: a split picks a file in a folder, but path "
            f"{path!r} is a file (point eval.env_args.path at the eval file instead)"
        )
    return base


def load_rows(file: Path) -> list[dict[str, Any]]:
    """Every row of a JSONL or Parquet file, cached per process by path, size and mtime."""
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    rows = _read_parquet(file) if file.suffix == ".parquet" else _read_jsonl(file)
    if not rows:
        raise ValueError(f"envpool.env_args.path: {file} holds no rows")
    _cache[key] = rows
    while len(_cache) > _CACHE_FILES:
        _cache.popitem(last=False)
    return rows


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(file.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"envpool.env_args.path: {file} line {number} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ValueError(f"envpool.env_args.path: {file} line {number} is not a JSON object")
        rows.append(row)
    return rows


def _read_parquet(file: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"envpool.env_args.path = {str(file)!r}: reading Parquet needs pyarrow "
            "(pip install 'millstream[data]'), or convert the file to JSONL"
        ) from None
    rows: list[dict[str, Any]] = pq.read_table(file).to_pylist()
    return rows


def load_reward(spec: str) -> Reward:
    """The function that "module:function" names; ValueError naming the key if it cannot."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"envpool.env_args.reward = {spec!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own error at import
        raise ValueError(
            f"envpool.env_args.reward = {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"envpool.env_args.reward = {spec!r}: {module_name} has no function {name!r}")
    return function


def _score(outcome: Any, spec: str) -> tuple[float, dict[str, Any]]:
    """(reward, info) from what a reward function returned; TypeError if it is not usable."""
    info: dict[str, Any] = {}
    value = outcome
    if isinstance(outcome, dict):
        if "reward" not in outcome:
            raise TypeError(f"reward function {spec} returned a dict without 'reward'")
        info = {k: v for k, v in outcome.items() if k != "reward"}
        value = outcome["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"reward function {spec} returned {value!r}, not a finite number")
    return float(value), info


@register("dataset")
class Dataset:
    def __init__(
        self,
        path: str = "",
        split: str = "train",
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        reward: str = "millstream.envpool.scoring.rewards:math_answer",
        system_prompt: str = "",
        mode: str = "single",
        max_attempts: int = 3,
        feedback: str = "That is not right. Try again.",
        success_reward: float = 1.0,
    ) -> None:
        self.attempts = Attempts(mode, max_attempts, feedback)
        self.file = resolve_path(path, split)
        self.rows = load_rows(self.file)
        for field in (prompt_field, answer_field):
            missing = next((i for i, row in enumerate(self.rows) if field not in row), None)
            if missing is not None:
                raise ValueError(
                    f"envpool.env_args: row {missing} of {self.file} has no field {field!r} "
                    f"(its fields: {', '.join(map(str, self.rows[missing]))})"
                )
        self.reward_spec = reward
        self.reward_fn = load_reward(reward)
        self.system_prompt = system_prompt
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.success_reward = success_reward
        self.row: dict[str, Any] = {}

    async def reset(self, seed: int) -> Observation:
        self.index = seed % len(self.rows)
        self.row = self.rows[self.index]
        self.attempts.start()
        return Observation(str(self.row[self.prompt_field]), anchor=f"row{self.index}/0")

    async def step(self, action: str) -> StepResult:
        self.attempts.take()
        answer = str(self.row[self.answer_field])
        reward, info = _score(self.reward_fn(action, answer, self.row), self.reward_spec)
        success = bool(info.pop("success", reward >= self.success_reward))
        info = {"valid": bool(info.pop("valid", True)), "success": success, "row": self.index, **info}
        last, text = self.attempts.outcome(success)
        anchor = f"row{self.index}/{self.attempts.count}"
        return StepResult(Observation(text, anchor=anchor), reward, last, info)


def shipped_sets() -> list[str]:
    """Names of the data sets shipped with millstream (`millstream:<name>`)."""
    return sorted(p.name for p in _SHIPPED_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))

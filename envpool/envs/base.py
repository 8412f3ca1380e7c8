"""What an environment is, and the registry that finds one by name.

An environment is text in, text out, and async, so thousands of them share one event loop:

    obs = await env.reset(seed)            # Observation(text, anchor)
    result = await env.step(action_text)   # StepResult(observation, reward, done, info)

The envpool owns tokenization and the chat format; an environment never sees token ids. It must be
deterministic given its seed (episodes of one GRPO group share the seed and must face the same
task), and expose a canonical `anchor` for each state: a string equal for equal states, which
GiGPO uses to compare steps across the episodes of a group.

`info` carries at least `valid` (was the action well-formed) and `success`. An environment that
raises or hangs does not crash anything: the episode ends with a recorded cause (see
envpool/episode.py). A badly formed *action* is not an error: the environment answers it with
`valid=False` and a format penalty, as RAGEN does.

Two optional fields of `Observation` shape the *next* turn's context, for flows where not every
generation is a plain chat reply:
- `trained=False`: the model still generates the next turn, but its tokens carry no loss
  (AgentFlow's executor and verifier turns around a trained planner);
- `new_context=True`: the next turn starts a fresh context, the system prompt plus this
  observation, followed by the last `carry_tokens` tokens the model generated, verbatim (ids, not
  re-tokenized text), as the start of the model's reply (Delethink's Markovian chunks: each chunk
  sees the query and a bounded carry-over only). The episode runner records where each context
  starts, and the learner trains every context as its own sequence.

Environments are found by name in `REGISTRY`; a third-party package adds one without touching
millstream through the entry-point group `millstream.envs` (`name = "pkg.module:Class"`), and a
one-file environment needs no packaging at all: `envpool.env = "my_env.py:MyEnv"` (or an
importable `module:Class`) loads it, with the same checks as a registered one.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Observation",
    "StepResult",
    "Env",
    "register",
    "make_env",
    "load_env_class",
    "env_names",
    "parse_answer",
    "parse_moves",
    "ENTRY_POINT_GROUP",
    "UnknownEnvironment",
]

ENTRY_POINT_GROUP = "millstream.envs"


@dataclass(frozen=True, slots=True)  # slotted: one per live episode, 10,000 at a time
class Observation:
    text: str
    #: Canonical state key: equal strings mean equal states (GiGPO anchors).
    anchor: str = ""
    #: Whether the model's reply to this observation is trained (False: generated, masked out).
    trained: bool = True
    #: Start a fresh context for the reply (see the module docstring; Delethink chunks).
    new_context: bool = False
    #: With `new_context`: how many of the last generated tokens open the new context's reply.
    carry_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: Observation
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    #: A system prompt for the chat context, or "" for none.
    system_prompt: str

    async def reset(self, seed: int) -> Observation: ...

    async def step(self, action: str) -> StepResult: ...


REGISTRY: dict[str, Callable[..., Env]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make an environment available as `envpool.env = "<name>"`."""

    def wrap(cls: type) -> type:
        REGISTRY[name] = cls
        return cls

    return wrap


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        REGISTRY.setdefault(ep.name, ep.load())


def env_names() -> list[str]:
    _load_entry_points()
    return sorted(REGISTRY)


class UnknownEnvironment(KeyError):
    """No environment of that name is registered or declared as an entry point."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def load_env_class(spec: str) -> Callable[..., Env]:
    """The class `spec` names without any packaging: `path/to/file.py:Class` (a path relative to
    the working directory, or absolute) or `package.module:Class` (importable as it stands).
    Registered under `spec`, so every later `make_env(spec)` reuses it."""
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UnknownEnvironment(f"no file {path}")
        module_name = "millstream_user_env_" + re.sub(r"\W", "_", str(path))
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise UnknownEnvironment(f"{path} failed to load: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise UnknownEnvironment(f"cannot import {where!r} ({exc})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise UnknownEnvironment(f"{where} has no {attr!r}")
    if not (callable(cls) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise UnknownEnvironment(f"{attr} is not an environment (it needs reset and step)")
    REGISTRY[spec] = cls
    return cls


def make_env(name: str, args: dict[str, Any] | None = None) -> Env:
    """Build an environment by name (registered, an entry point, or `file.py:Class` /
    `module:Class`); unknown names and bad arguments are clear errors."""
    if name not in REGISTRY:
        _load_entry_points()
    if name not in REGISTRY and re.fullmatch(r"[^:]+:[A-Za-z_]\w*", name):
        load_env_class(name)
    if name not in REGISTRY:
        known = env_names()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownEnvironment(f"unknown environment {name!r}{hint} (known: {', '.join(known)})")
    try:
        return REGISTRY[name](**(args or {}))
    except TypeError as exc:
        raise TypeError(f"environment {name!r} rejected envpool.env_args={args!r}: {exc}") from None


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def parse_answer(text: str) -> list[str] | None:
    """RAGEN's action format: `<think>...</think><answer>a || b</answer>` -> ["a", "b"].

    Returns None when there is no answer block (the caller applies its format penalty).
    """
    match = _ANSWER.search(text)
    if match is None:
        return None
    actions = [part.strip() for part in match.group(1).split("||")]
    return [a for a in actions if a] or None


def parse_moves(text: str, allowed, max_moves: int) -> list[str] | None:
    """Grid games' actions: up to `max_moves` names from `allowed` (case-insensitive) in one
    answer block, e.g. `<answer>Up || Left</answer>` -> ["up", "left"]; None if any is unknown."""
    answer = parse_answer(text)
    if answer is None or len(answer) > max_moves:
        return None
    moves = [a.lower() for a in answer]
    return moves if all(m in allowed for m in moves) else None

"""Environments, by name. Importing this package registers the built-in ones.

Layout: `base.py` defines Observation/StepResult, the Env protocol and the registry (with the
`millstream.envs` entry-point group for third-party environments). The environments live in
rooms by kind, one module each with its rules in its docstring:

    games/   RAGEN's and TinyZero's games: bandit, countdown, frozenlake, guessnumber, sokoban
    tasks/   text tasks: dataset (prompts and answers), reasoninggym (any reasoning-gym task),
             markovian (Delethink), agentflow
    tools/   tool use: pytool (Python in sandbox/), search (Search-R1, offline corpus)
    agents/  agent environments: the contract (agent.py) and openai_agent
    checks/  the loop's own checks: evenchars, echo, noop, flaky (fault injection)
    data/    the shipped data sets

Every module of a room is imported (so registered) below: adding an environment is adding a
module to a room.
"""

import importlib
import pkgutil

from millstream.envpool.envs.base import (
    ENTRY_POINT_GROUP,
    Env,
    Observation,
    StepResult,
    UnknownEnvironment,
    env_names,
    make_env,
    parse_answer,
    parse_moves,
    register,
)

ROOMS = ("games", "tasks", "tools", "agents", "checks")

for _room in ROOMS:
    _package = importlib.import_module(f"{__name__}.{_room}")
    for _module in pkgutil.iter_modules(_package.__path__):
        if not _module.ispkg and not _module.name.startswith("_"):  # tools/sandbox: not an env
            importlib.import_module(f"{__name__}.{_room}.{_module.name}")  # registration side effects

__all__ = [
    "Env",
    "Observation",
    "StepResult",
    "make_env",
    "env_names",
    "register",
    "parse_answer",
    "parse_moves",
    "ENTRY_POINT_GROUP",
    "UnknownEnvironment",
]

"""Environments, by name. Importing this package registers the built-in ones.

Layout: `base.py` defines Observation/StepResult, the Env protocol and the registry (with the
`millstream.envs` entry-point group for third-party environments); every other module here is
one environment with its rules in its docstring, and is imported (so registered) below: adding
an environment is adding a module.
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

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base" and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")  # registration side effects

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

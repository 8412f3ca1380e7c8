"""Environments, by name. Importing this package registers the built-in ones.

Layout: `base.py` defines Observation/StepResult, the Env protocol and the registry (with the
`millstream.envs` entry-point group for third-party environments); each other module is one
environment with its rules in its docstring.
"""

from . import bandit, evenchars, flaky  # noqa: F401  (registration side effects)
from .base import ENTRY_POINT_GROUP, Env, Observation, StepResult, env_names, make_env, parse_answer, register

__all__ = ["Env", "Observation", "StepResult", "make_env", "env_names", "register", "parse_answer",
           "ENTRY_POINT_GROUP"]

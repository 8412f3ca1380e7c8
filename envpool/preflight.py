"""The envpool's check of a config before a run starts: `millstream envpool --check`.

`millstream run` calls it before it makes the run directory or starts any role, because only
the envpool can answer these questions (the launcher lives in `shared/` and imports no role):

- does `envpool.env` name an environment (a built-in module or a `millstream.envs` entry
  point), and do `envpool.env_args` suit its constructor?
- with `eval.every` > 0: does the evaluation environment (`eval.env`, `eval.env_args`) build?
- does the model directory hold a tokenizer and a chat template the envpool can use, and does
  that template accept the environment's conversation (a Gemma-style template refuses a system
  prompt with `raise_exception`: caught here, not in the first episode)? A template that
  re-renders earlier turns (envpool/chat/format.py) is logged as a warning, not refused.
- does the first prompt of a sample episode leave room for `envpool.max_tokens` within
  `actor.max_model_len`? (Prompts differ by seed, so this can only catch a budget that cannot
  fit; a longer prompt at run time ends its episode as the counted cause `prompt_too_long`.)

Each problem is one line on stdout naming the key (logs go to stderr), and the exit status is 2,
as for any config error. It calls the environment's `reset` once (so a broken environment shows
here), but sends no request to an actor and opens no socket of its own.
"""

from __future__ import annotations

import logging

import anyio

from millstream.envpool.agents.episode import is_agent_env
from millstream.envpool.chat import ChatFormat, ChatTemplateError, tokenizer_dir
from millstream.envpool.envs import Env, Observation, UnknownEnvironment, make_env
from millstream.envpool.scoring.evaluator import eval_env
from millstream.envpool.scoring.judge import judge_messages
from millstream.envpool.seeds import group_seed
from millstream.shared.config import Config

__all__ = ["preflight", "check_envpool"]

log = logging.getLogger("envpool")


def check_envpool(cfg: Config) -> str | None:
    """What is wrong with the envpool's settings, in one line, or None."""
    pool = cfg.envpool
    try:
        env = make_env(pool.env, pool.env_args)
    except UnknownEnvironment as exc:
        return f"envpool.env = {pool.env!r}: {exc}"
    except (TypeError, ValueError) as exc:  # said once: an environment may name the key itself
        said = str(exc)
        return said if said.startswith("envpool.env_args") else f"envpool.env_args: {said}"
    except Exception as exc:  # the environment's own constructor failed: say so in one line
        return f"envpool.env = {pool.env!r}: its constructor raised {type(exc).__name__}: {exc}"
    problem = _check_eval_env(cfg) or _check_judge(cfg, env)
    if problem is not None:
        return problem
    try:
        chat = ChatFormat.from_model_dir(tokenizer_dir(cfg))
    except (OSError, ValueError) as exc:
        return f"model.path: the envpool cannot use its tokenizer: {exc}"
    if is_agent_env(env):
        # An agent's prompts come from the agent itself: only its extra can be checked here,
        # and whether its calls can stay one sequence (envpool/agents/splice.py).
        if chat.rerenders:
            log.warning(
                "%s; for the agent environment %r this means every call after a reply the "
                "template rewrites is rendered afresh and trained as a new segment "
                "(episode/segments_mean)",
                chat.rerenders,
                pool.env,
            )
        return _check_agents_extra(pool.env)
    seed = group_seed(cfg.run.seed, 0)
    try:
        obs = anyio.run(_first_observation, env, seed, pool.step_timeout_s, backend="trio")
    except Exception as exc:  # the environment's own failure: report it, as a run would
        return f"envpool.env = {pool.env!r}: reset({seed}) failed: {type(exc).__name__}: {exc}"
    system = getattr(env, "system_prompt", "")
    try:
        prompt = len(chat.first_prompt(system, obs.text))
        chat.next_prompt(obs.text)  # a second turn renders too
    except ChatTemplateError as exc:
        with_system = ", which has a system prompt," if system else ""
        return f"model.path: {exc} (rendering the conversation of envpool.env = {pool.env!r}{with_system})"
    if chat.rerenders:
        log.warning("%s (see envpool/chat/format.py)", chat.rerenders)
    if prompt + pool.max_tokens > cfg.actor.max_model_len:
        return (
            f"envpool.max_tokens = {pool.max_tokens}: the first prompt of {pool.env!r} "
            f"(seed {seed}) has {prompt} tokens, and {prompt} + {pool.max_tokens} exceeds "
            f"actor.max_model_len = {cfg.actor.max_model_len}"
        )
    return None


def _check_eval_env(cfg: Config) -> str | None:
    if not cfg.eval.every:
        return None
    name, args = eval_env(cfg)
    try:
        env = make_env(name, args)
    except Exception as exc:  # named for the eval keys: the training env built fine
        return f"eval.env / eval.env_args (evaluation env {name!r}, arguments {args!r}): {exc}"
    if is_agent_env(env):
        return (
            f"eval.every = {cfg.eval.every}: evaluation rounds play text environments, and "
            f"{name!r} is an agent environment (set eval.env to a text one, or eval.every = 0)"
        )
    return None


def _check_judge(cfg: Config, env: Env) -> str | None:
    """The judge grades a transcript of observations and replies, in its own chat template."""
    judge = cfg.judge
    if not judge.model_path:
        return None
    if is_agent_env(env):
        return (
            f"judge.model_path: the judge grades observations and replies, and agent episodes "
            f"(envpool.env = {cfg.envpool.env!r}) record only the model's calls; score inside the "
            "agent instead"
        )
    try:
        chat = ChatFormat.from_model_dir(judge.model_path)
        chat.apply(
            judge_messages(judge.system_prompt, judge.rubric.format(task="t", response="r", transcript="x"))
        )
    except (OSError, ValueError) as exc:  # ChatTemplateError is a ValueError
        return f"judge.model_path: {exc} (rendering judge.system_prompt and judge.rubric)"
    return None


def _check_agents_extra(name: str) -> str | None:
    import importlib.util

    missing = [m for m in ("openai", "starlette", "hypercorn") if importlib.util.find_spec(m) is None]
    if missing:
        return f"envpool.env = {name!r} runs an agent: install the agents extra (missing {missing})"
    return None


async def _first_observation(env: Env, seed: int, timeout_s: float) -> Observation:
    with anyio.fail_after(timeout_s):
        return await env.reset(seed)


def preflight(cfg: Config) -> int:
    """`millstream envpool --check`: 0 if the envpool's settings hold, else 2 and one line."""
    problem = check_envpool(cfg)
    if problem is None:
        return 0
    print(problem)
    return 2

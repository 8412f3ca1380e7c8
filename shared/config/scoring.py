"""The config sections about how a run is scored and watched: evaluation rounds (`[eval]`), the
dashboards the learner's records go to (`[metrics]`), and a frozen LLM judge as the reward
(`[judge]`). Apart from shared/config/schema.py only to keep each module readable; the same
rules hold (one doc line per field, ranges and choices in the types).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from millstream.shared.config.meta import doc as _doc

__all__ = ["EvalConfig", "MetricsConfig", "JudgeConfig", "StoreConfig"]


class JudgeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model_path: Annotated[
        str,
        _doc(
            'A frozen judge model\'s directory ("": no judge). The launcher serves it with one '
            "more actor, `judge`, that never takes weight updates; every finished episode is then "
            "scored by it (envpool/scoring/judge.py).",
        ),
    ] = ""
    address: Annotated[
        str, _doc("ROUTER address the judge actor binds (port 0: the launcher picks a free one).")
    ] = "tcp://127.0.0.1:0"
    connect: Annotated[
        str, _doc("Address of a judge actor already running; the launcher then starts none.")
    ] = ""
    system_prompt: Annotated[str, _doc('The judge\'s system prompt ("": none).')] = (
        "You grade answers. Reply with a line 'Score: N', N from 0 to 10."
    )
    rubric: Annotated[
        str,
        _doc(
            "The judge's user message; {task} is the episode's first observation, {response} "
            "the policy's last reply, {transcript} the whole conversation as text.",
        ),
    ] = "Task:\n{task}\n\nAnswer:\n{response}\n\nGrade the answer."
    score_pattern: Annotated[
        str,
        _doc(
            "Regular expression whose first group is the score in the judge's reply (the first "
            "match counts). No match: the episode fails as judge_unparsable, never reward 0.",
        ),
    ] = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
    max_score: Annotated[
        float, _doc("The judge's top score; the reward is score / max_score, clipped to [0, 1].", gt=0)
    ] = 10.0
    mode: Annotated[
        Literal["replace", "add"],
        _doc(
            "replace: the judged score is the episode's reward (on its last turn); add: it is "
            "added, times `weight`, to the environment's reward of the last turn.",
        ),
    ] = "replace"
    weight: Annotated[float, _doc("Factor on the judged score in mode 'add'.")] = 1.0
    max_tokens: Annotated[int, _doc("The judge's reply budget, tokens.", ge=1)] = 32
    temperature: Annotated[float, _doc("The judge's sampling temperature (0: greedy).", ge=0)] = 0.0
    timeout_s: Annotated[
        float, _doc("Longest wait for one judgement; then retried (judge.retries).", gt=0)
    ] = 120.0
    retries: Annotated[int, _doc("Retries of a judgement that timed out or was refused.", ge=0)] = 2


class EvalConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Evaluation during training (envpool/scoring/evaluator.py): envpool worker 0 plays a round of
    evaluation episodes for every policy version divisible by `every`, and for the final one;
    they are never trained on, and the learner writes their results as `eval/...` metrics."""

    every: Annotated[
        int, _doc("Evaluate every N policy versions (0 included, and the final one); 0: no evaluation.", ge=0)
    ] = 0
    episodes: Annotated[
        int, _doc("Problems per evaluation round: seeds `seed` .. `seed + episodes - 1`.", ge=1)
    ] = 32
    samples: Annotated[
        int,
        _doc("Episodes per problem (k of pass@k); more than 1 needs a temperature above 0.", ge=1),
    ] = 1
    temperature: Annotated[
        float, _doc("Sampling temperature of evaluation episodes (0: greedy).", ge=0, le=2)
    ] = 0.0
    seed: Annotated[int, _doc("First evaluation seed (the dataset env plays row `seed mod rows`).", ge=0)] = 0
    env: Annotated[str, _doc("Environment of evaluation episodes; empty: envpool.env.")] = ""
    env_args: Annotated[
        dict[str, Any],
        _doc(
            "Arguments of the evaluation environment, merged over envpool.env_args when `env` is "
            'empty (e.g. {split = "eval"} for the dataset env).'
        ),
    ] = {}
    max_concurrent: Annotated[int, _doc("Evaluation episodes running at once.", ge=1)] = 64
    timeout_s: Annotated[
        float,
        _doc(
            "Longest one evaluation round may take; its unfinished episodes then count as failed "
            "(episode_timeout). The learner also waits this long at the end for the final round.",
            gt=0,
        ),
    ] = 300.0


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the learner's per-step records go besides `metrics.jsonl` (shared/obs/dashboards.py).
    Every backend gets the same flat numeric keys as `metrics.jsonl`, at step = training step."""

    backends: Annotated[
        list[Literal["jsonl", "tensorboard", "wandb"]],
        _doc(
            "Metric sinks: jsonl (always required: `millstream plot` and resumes read it), "
            "tensorboard (event files in <run.dir>/tensorboard; extra `dashboards`), wandb (an "
            "offline run in <run.dir>/wandb, never touches the network; extra `dashboards`)."
        ),
    ] = msgspec.field(default_factory=lambda: ["jsonl"])
    wandb_mode: Annotated[
        Literal["offline", "online"],
        _doc(
            "wandb: offline (a run in <run.dir>/wandb, no network; `wandb sync` uploads it later) or "
            "online (logs live; the key comes from WANDB_API_KEY or `wandb login`, as with any W&B run)."
        ),
    ] = "offline"
    wandb_project: Annotated[str, _doc("wandb: the W&B project name of the run.")] = "millstream"
    wandb_name: Annotated[str, _doc("wandb: the run's display name (empty: the run directory's name).")] = ""
    wandb_tags: Annotated[list[str], _doc("wandb: tags of the run.")] = msgspec.field(default_factory=list)


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The trajectory store, `<run.dir>/store.sqlite` (shared/store/trajstore.py): every trained,
    dropped and failed episode with its turns, read by `millstream inspect` and `millstream debug`.
    The learner writes it from a thread (shared/store/writer.py): the run never waits on it."""

    enabled: Annotated[
        bool, _doc("Keep the store (false: no store.sqlite; inspect has nothing to show).")
    ] = True
    keep_success: Annotated[
        float,
        _doc(
            "Share of trained episodes kept (chosen by episode id, so the same ones every time); "
            "failed and dropped episodes are always kept.",
            ge=0.0,
            le=1.0,
        ),
    ] = 1.0
    max_mb: Annotated[
        float,
        _doc(
            "Size cap in MiB (0: none). Past it the oldest trained episodes are deleted to make room, "
            "then the oldest of any kind: a week-long run does not fill the disk.",
            ge=0.0,
        ),
    ] = 4096.0
    queue: Annotated[
        int,
        _doc(
            "Episodes the writer thread may hold unwritten; past it new ones are dropped and counted.", ge=1
        ),
    ] = 8192
    jsonl: Annotated[
        bool,
        _doc(
            "Also write trajectories.jsonl (a JSON line per trained or failed episode), as before the store."
        ),
    ] = False

"""The dataset environment and the math-answer reward: matching rules (with hypothesis), JSONL
and Parquet files, the shipped arithmetic set, feedback mode, and the clear errors that bad
`envpool.env_args` give before a run starts (the envpool's preflight)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from millstream.envpool.envs import make_env
from millstream.envpool.envs.tasks.dataset import Dataset
from millstream.envpool.preflight import check_envpool
from millstream.envpool.scoring.evaluator import summarize
from millstream.envpool.scoring.rewards import extract_answer, math_answer, parse_number
from millstream.shared.config import load_config
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory

# --- the reward ------------------------------------------------------------------------------


@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_integers_match_in_every_spelling(n):
    spellings = [str(n), f"{n}.0", f"{n:,}", f"${n}$", f"{n}."]
    for text in spellings:
        assert parse_number(text) == n, text
        assert math_answer(f"so the answer is {text}", str(n), {})["reward"] == 1.0, text
    assert math_answer(f"the answer is {n + 1}", str(n), {})["reward"] == 0.0


@given(st.integers(-1000, 1000), st.integers(1, 1000))
def test_fractions_and_decimals_are_exact(num, den):
    value = Fraction(num, den)
    assert parse_number(f"{num}/{den}") == value
    assert parse_number(f"\\frac{{{num}}}{{{den}}}") == value
    assert math_answer(f"\\boxed{{\\frac{{{num}}}{{{den}}}}}", f"{num}/{den}", {})["success"]
    assert parse_number("0.1") == Fraction(1, 10) and parse_number("1.50") == Fraction(3, 2)


@given(st.text(alphabet="abc xyz,.!?", max_size=30), st.integers(0, 99), st.integers(0, 99))
def test_boxed_wins_over_later_numbers_else_the_last_number(noise, boxed, last):
    assert extract_answer(f"{noise} \\boxed{{{boxed}}} {noise} {last}") == str(boxed)
    assert extract_answer(f"{noise} {boxed} {noise} {last}") == str(last)


def test_answer_extraction_edge_cases():
    assert extract_answer("no digits here") is None
    assert extract_answer("\\boxed{x = {4}}") == "x = {4}"
    assert math_answer("\\boxed{x = {4}}", "4", {})["success"]  # the number inside the box
    assert extract_answer("3 then \\boxed{4") == "4"  # an unclosed box is no box: last number
    assert parse_number("1,23") is None and parse_number("1" * 100) is None
    assert parse_number("3/0") is None and parse_number("") is None
    assert math_answer("The answer is blue.", "blue", {})["reward"] == 0.0  # text: whole answer
    assert math_answer("\\boxed{blue}", "blue", {})["reward"] == 1.0
    result = math_answer("nothing", "4", {})
    assert result == {"reward": 0.0, "success": False, "valid": False}


# --- the environment -------------------------------------------------------------------------


def play(env, seed, actions):
    async def episode():
        first = await env.reset(seed)
        results = []
        for action in actions:
            results.append(await env.step(action))
            if results[-1].done:
                break
        return first, results

    return anyio.run(episode, backend="trio")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"q": "What is 2 + 2?", "a": "4"}, {"q": "What is 3 * 3?", "a": 9}]


def test_jsonl_rows_by_seed_and_single_turn_rewards(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    env = make_env("dataset", {"path": str(path), "prompt_field": "q", "answer_field": "a"})
    first, [result] = play(env, 2, ["I think it is 4."])
    assert first.text == "What is 2 + 2?" and result.done and result.reward == 1.0
    assert result.info["success"] and result.info["valid"]
    first, [result] = play(env, 3, ["It is \\boxed{8}, not 9"])  # seed 3 -> row 1; boxed wins
    assert first.text == "What is 3 * 3?" and result.reward == 0.0 and not result.info["success"]


def test_feedback_mode_retries_until_right_or_out_of_attempts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    args = {"path": str(path), "prompt_field": "q", "answer_field": "a", "mode": "feedback"}
    env = make_env("dataset", {**args, "max_attempts": 3, "feedback": "Wrong."})
    _, results = play(env, 0, ["5", "no idea", "4", "unreached"])
    assert [r.reward for r in results] == [0.0, 0.0, 1.0]
    assert [r.done for r in results] == [False, False, True]
    assert results[0].observation.text == "Wrong." and results[1].info["valid"] is False
    _, results = play(env, 0, ["1", "2", "3", "4"])
    assert len(results) == 3 and results[-1].done and not results[-1].info["success"]


def test_parquet_file_reads_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"q": r["q"], "a": int(r["a"])} for r in ROWS]  # a Parquet column has one type
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    env = make_env("dataset", {"path": str(tmp_path / "d.parquet"), "prompt_field": "q", "answer_field": "a"})
    first, [result] = play(env, 1, ["9"])
    assert first.text == "What is 3 * 3?" and result.reward == 1.0


def custom_reward(response: str, answer: str, row: dict) -> float:
    """A reward function for the tests: the length of the response, or it raises on 'boom'."""
    if "boom" in response:
        raise RuntimeError("reward function failed")
    return float(len(response)) if "nan" not in response else float("nan")


def test_custom_reward_function_and_its_failures_raise(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    env = Dataset(str(path), prompt_field="q", answer_field="a", reward=f"{__name__}:custom_reward")
    _, [result] = play(env, 0, ["abc"])
    assert result.reward == 3.0 and result.info["success"]  # 3 >= success_reward 1.0
    # Raising is how a broken reward reaches the episode runner: env_error, never reward 0.
    with pytest.raises(RuntimeError, match="reward function failed"):
        play(env, 0, ["boom"])
    with pytest.raises(TypeError, match="not a finite number"):
        play(env, 0, ["nan"])


def test_shipped_arithmetic_set_has_train_and_eval_splits():
    train = Dataset("millstream:arithmetic")
    held = Dataset("millstream:arithmetic", split="eval")
    assert len(train.rows) == 512 and len(held.rows) == 12
    problem = lambda r: (r["a"], r["op"], r["b"])  # noqa: E731
    assert not {problem(r) for r in train.rows} & {problem(r) for r in held.rows}
    for row in train.rows + held.rows:
        value = row["a"] + row["b"] if row["op"] == "+" else row["a"] - row["b"]
        assert str(value) == row["answer"] and 0 <= value <= 3
    first, [result] = play(held, 0, [f"it is {held.rows[0]['answer']}"])
    assert first.text == held.rows[0]["prompt"] and result.reward == 1.0


def test_the_generator_reproduces_the_shipped_files(tmp_path, monkeypatch):
    import importlib.util

    here = Path(__file__).resolve().parent.parent / "envpool/envs/data/arithmetic"
    spec = importlib.util.spec_from_file_location("generate_arithmetic", here / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", tmp_path)
    module.main()
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (here / name).read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "envpool.env_args.path is required"),
        ({"path": "/nonexistent/x.jsonl"}, "envpool.env_args.path = '/nonexistent/x.jsonl': no such file"),
        ({"path": "millstream:nope"}, "shipped: arithmetic"),
        ({"path": "millstream:arithmetic", "split": "test"}, "envpool.env_args.split = 'test'"),
        ({"path": "D", "prompt_field": "question"}, "row 0 of .* has no field 'question'"),
        ({"path": "D", "reward": "no_such_module_xyz:f"}, "cannot import 'no_such_module_xyz'"),
        ({"path": "D", "reward": "millstream.envpool.scoring.rewards:nope"}, "has no function 'nope'"),
        ({"path": "D", "reward": "just_a_name"}, "expected 'module:function'"),
        ({"path": "D", "mode": "chat"}, "envpool.env_args.mode = 'chat'"),
        ({"path": "BAD"}, "line 2 is not JSON"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path, args, message):
    good = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "answer": "1"}\n{oops\n')
    args = {**args, "path": {"D": str(good), "BAD": str(bad)}.get(args.get("path", ""), args.get("path", ""))}
    if not args["path"]:
        del args["path"]
    with pytest.raises(ValueError, match=message):
        make_env("dataset", args)


def test_preflight_names_the_key_before_a_run(tiny_model_dir, tmp_path):
    base = [f"model.path={tiny_model_dir}", "envpool.env=dataset"]
    cfg = load_config(None, [*base, "envpool.env_args.path=millstream:arithmetic"])
    assert check_envpool(cfg) is None
    cfg = load_config(None, [*base, "envpool.env_args.path=/nope.jsonl"])
    assert (problem := check_envpool(cfg)) and problem.startswith(
        "envpool.env_args.path = "
    )  # the key said once
    bad_eval = [
        *base,
        "envpool.env_args.path=millstream:arithmetic",
        "eval.every=5",
        'eval.env_args={split="x"}',
    ]
    assert (problem := check_envpool(load_config(None, bad_eval))) and problem.startswith("eval.env")
    assert check_envpool(load_config(None, [*bad_eval[:-1], 'eval.env_args={split="eval"}'])) is None


# --- evaluation numbers ----------------------------------------------------------------------


def trajectory(reward: float, versions: list[int]) -> Trajectory:
    n = len(versions)
    return Trajectory(
        "e", "g", 0, "dataset", [1] * n, [1] * n, [0.0] * n, versions, reward, [reward], 1, 2, 0.1
    )


def test_eval_summary_leaves_failures_out_of_means_and_counts_pass_at_k():
    """Failures are left out problem by problem: pass@1 is the mean of each problem's share of
    successes (a problem whose samples failed weighs as much as the others), and pass@k is over
    the problems whose k samples all finished (problem 1, one sample short, was counted as
    unsolved at pass@2 from a single try)."""
    failed = EpisodeFailed("e", "g", 2, Cause.ENV_ERROR, "x")
    outcomes = {
        (0, 0): (trajectory(1.0, [3, 4]), True),
        (0, 1): (trajectory(0.0, [4]), False),
        (1, 0): (trajectory(0.0, [5]), False),
        (1, 1): (failed, False),
        (2, 0): (failed, False),
        # (2, 1) never finished: the round timed out
    }
    numbers = summarize(outcomes, problems=3, samples=2)
    assert numbers["finished"] == 3 and numbers["failed"] == {"env_error": 2, "episode_timeout": 1}
    assert numbers["reward_mean"] == pytest.approx(1 / 3)
    assert numbers["success"] == pytest.approx((1 / 2 + 0 / 1) / 2)  # problem 2 had no episode
    assert numbers["pass_at_k"] == 1.0 and numbers["pass_at_k_problems"] == 1  # problem 0 only
    assert numbers["token_versions"] == [3, 5]


def test_eval_rounds_queue_only_due_versions_and_the_newest_waits():
    from millstream.envpool.scoring.evaluator import Evaluator, eval_env

    overrides = ["envpool.env=dataset", "envpool.env_args.path=millstream:arithmetic", "eval.every=5"]
    cfg = load_config(None, [*overrides, 'eval.env_args={split="eval"}'])
    assert eval_env(cfg) == ("dataset", {"path": "millstream:arithmetic", "split": "eval"})

    async def main():
        evaluator = Evaluator(cfg, "w0", None, None, None, lambda: 1024)  # queueing only: no actor
        evaluator.notice(3)
        assert evaluator.pending is None  # not due
        evaluator.notice(5)
        evaluator.notice(5)  # the learner's heartbeat repeats a version
        assert evaluator.pending == 5 and evaluator.skipped == 0
        evaluator.notice(10)  # one round at a time: the newest due version replaces the waiting one
        assert evaluator.pending == 10 and evaluator.skipped == 1
        evaluator.pending = None
        evaluator.evaluated.add(10)
        evaluator.notice(10)
        assert evaluator.pending is None  # evaluated once only
        evaluator.notice(12, force=True)  # the final version is evaluated whether due or not
        assert evaluator.pending == 12

    anyio.run(main, backend="trio")


class OneReply:
    """A stand-in actor for one turn: replies with the tokens of `text` (the episode runner's
    handling of the reward is under test, not generation)."""

    def __init__(self, chat, text):
        self.ids = chat.tokenizer.encode(text).ids

    async def generate(self, prompt_token_ids, sampling, **_):
        from millstream.envpool.actors.client import Generation

        return Generation(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "length")


def test_a_failing_reward_function_ends_the_episode_as_env_error_never_reward_0(tiny_model_dir, tmp_path):
    from millstream.envpool.chat import ChatFormat
    from millstream.envpool.episode import EpisodeSpec, run_episode
    from millstream.shared.config import EnvPoolConfig

    chat = ChatFormat.from_model_dir(tiny_model_dir)
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    spec = EpisodeSpec("e0", "g0", seed=0, member=0, group_size=1, env_name="dataset")

    def play_one(reply):
        env = Dataset(str(path), prompt_field="q", answer_field="a", reward=f"{__name__}:custom_reward")
        client = OneReply(chat, reply)
        return anyio.run(run_episode, spec, env, chat, client, EnvPoolConfig(), 1024, backend="trio")

    failed = play_one("boom")
    assert isinstance(failed, EpisodeFailed) and failed.cause == Cause.ENV_ERROR
    assert "reward function failed" in failed.message
    scored = play_one("abc")
    assert isinstance(scored, Trajectory) and scored.reward == 3.0

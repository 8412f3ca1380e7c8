"""The LLM judge as a reward (envpool/scoring/judge.py): scores read from its reply, failures counted as
causes, the judge actor frozen, and a run whose rewards come from a real vLLM judge."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import orjson
import pytest
from helpers import check_accounting, dealer, millstream_run, read_episodes, replies, start_actor
from hypothesis import given
from hypothesis import strategies as st

from millstream.bench.kit.spawn import stop
from millstream.envpool.scoring.judge import JudgeFailed, _rescored, read_score, render_rubric
from millstream.shared.config import ConfigError, load_config
from millstream.shared.obs.metrics import read_jsonl
from millstream.shared.process.runtime import free_port
from millstream.shared.wire import AttachLearner, Cause, Codec, ErrorReply, ReplyCause, Trajectory

DEFAULT = re.compile(load_config(None, []).judge.score_pattern)


def trajectory(texts: list[str], turn_rewards: list[float]) -> Trajectory:
    return Trajectory(
        episode_id="e",
        group_id="g",
        seed=1,
        env="echo",
        token_ids=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        versions=[-1, 0],
        reward=sum(turn_rewards),
        turn_rewards=turn_rewards,
        num_turns=len(turn_rewards),
        group_size=1,
        duration_s=0.1,
        texts=texts,
    )


@given(st.integers(0, 10), st.sampled_from(["Score: {}", "score={}", "SCORE {}/10", "I give it. Score:{}."]))
def test_a_score_the_judge_writes_is_read_back_scaled(score, form):
    assert read_score(DEFAULT, "Some reasoning.\n" + form.format(score), 10.0) == score / 10


@given(st.floats(-1e6, 1e6, allow_nan=False))
def test_scores_are_clipped_into_0_1(score):
    assert 0.0 <= read_score(re.compile(r"(-?[\d.e+-]+)"), repr(score), 10.0) <= 1.0


@pytest.mark.parametrize("reply", ["", "I cannot grade this.", "Score: none", "Score: nan"])
def test_a_reply_without_a_score_is_a_counted_cause_not_a_zero(reply):
    with pytest.raises(JudgeFailed) as caught:
        read_score(DEFAULT, reply, 10.0)
    assert caught.value.cause is Cause.JUDGE_UNPARSABLE


def test_the_rubric_sees_the_task_the_last_reply_and_the_transcript():
    traj = trajectory(["What is 2+2?", "5", "Wrong, again.", "4", "Right."], [0.0, 1.0])
    text = render_rubric("T={task}|R={response}|X={transcript}", traj)
    assert text.startswith("T=What is 2+2?|R=4|X=User: What is 2+2?\n\nAssistant: 5\n\nUser: Wrong")


def test_replace_puts_the_judged_score_on_the_last_turn_and_add_adds_it():
    traj = trajectory(["q", "a", "o", "b", ""], [0.25, 0.5])
    replaced = _rescored(traj, 0.7, "replace", 1.0)
    assert replaced.turn_rewards == [0.0, 0.7] and replaced.reward == 0.7
    added = _rescored(traj, 0.7, "add", 2.0)
    assert added.turn_rewards == [0.25, 0.5 + 1.4] and added.reward == pytest.approx(0.25 + 1.9)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("judge.score_pattern='(unclosed'", "not a regular expression"),
        ("judge.score_pattern='\\d+'", "needs a group"),
        ("judge.rubric='{task} {grade}'", "{task}, {response}, {transcript}"),
    ],
)
def test_a_bad_judge_config_is_refused_naming_the_key(override, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(None, [override])


def test_a_judge_to_connect_to_needs_its_model_for_the_tokenizer():
    with pytest.raises(ConfigError, match="also set judge.model_path"):
        load_config(None, ["judge.connect=tcp://127.0.0.1:5999"])


def test_a_judge_for_an_agent_env_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    from millstream.shared.launch.launcher import prepare

    with pytest.raises(ConfigError, match="judge.model_path: .*agent episodes"):
        prepare(
            None,
            [
                f"run.dir={tmp_path / 'run'}",
                f"model.path={tiny_model_dir}",
                f"judge.model_path={tiny_model_dir}",
            ]
            + ["envpool.env=openai_agent"],
        )


def test_a_judge_template_that_refuses_the_rubric_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    """A Gemma-style judge template raises on the (default) system prompt: said at once, not as
    every episode failing in the run."""
    from test_chat_templates import write_model_dir

    from millstream.shared.launch.launcher import prepare

    gemma = write_model_dir(tiny_model_dir, tmp_path / "gemma", "gemma")
    shutil.copy(Path(tiny_model_dir) / "config.json", gemma)  # a tokenizer-only copy so far
    args = [f"run.dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", f"judge.model_path={gemma}"]
    with pytest.raises(ConfigError, match="judge.model_path: .*rendering judge.system_prompt"):
        prepare(None, args)
    prepare(None, [*args, "judge.system_prompt=''"])  # without a system turn it renders


def test_a_judge_model_that_is_not_a_model_directory_is_refused_before_anything_starts(tmp_path):
    from millstream.shared.launch.launcher import prepare

    with pytest.raises(ConfigError, match="judge.model_path"):
        prepare(None, [f"run.dir={tmp_path / 'run'}", f"judge.model_path={tmp_path}"])


@pytest.mark.slow
def test_the_judge_actor_refuses_weights(tiny_model_dir, tmp_path):
    """Even from the learner's key: a judge graded by moving weights could be gamed."""
    address = f"tcp://127.0.0.1:{free_port()}"
    _, proc, _ = start_actor(
        tiny_model_dir,
        tmp_path,
        "actor.kind=synthetic",
        f"judge.model_path={tiny_model_dir}",
        f"judge.address={address}",
        "--judge",  # after the overrides: argparse takes no option between positionals
        address=address,
        timeout_s=120,
    )
    try:
        judge = orjson.loads(next(tmp_path.glob("actor-*.json")).read_bytes())
        assert judge["replica"] == "judge"
        sock = dealer(address, role="learner")
        sock.send(Codec().encode([AttachLearner("s", "127.0.0.1", 1, 2, "gloo", 5.0)]))
        got = replies(sock, 10.0, until=ReplyCause.FROZEN)
        sock.close()
        assert any(isinstance(m, ErrorReply) and m.cause == ReplyCause.FROZEN for m in got)
    finally:
        stop(proc, grace_s=0)


@pytest.mark.real
def test_a_run_takes_its_rewards_from_a_real_frozen_judge(actor, tmp_path):
    """The policy is the session's vLLM actor; the judge is one more vLLM engine the launcher
    starts on the same tiny model. A random model rarely writes a score, so the pattern takes
    the first digit it writes: episodes whose judge reply has one are trained with that digit / 9
    as their reward, the others fail as judge_unparsable, and every episode is accounted for."""
    run_dir = tmp_path / "run"
    millstream_run(
        actor,
        run_dir,
        f"judge.model_path={actor.model_dir}",
        "judge.score_pattern='(\\d)'",
        "judge.max_score=9",
        "judge.max_tokens=48",
        "judge.temperature=1.0",
        "train.steps=2",
        "train.group_size=4",
        "train.groups_per_batch=2",
        "envpool.env=echo",
    )
    summary = check_accounting(run_dir)
    trained = [r for r in read_episodes(run_dir) if r["fate"] == "trained"]
    assert trained and all(
        r["turn_rewards"][-1] * 9 == pytest.approx(round(r["reward"] * 9)) for r in trained
    )
    failed = summary["episodes_failed"]
    assert set(failed) <= {"judge_unparsable", "judge_failed", "run_ended"}
    stats = [r["judge"] for r in read_jsonl(run_dir / "envpool-w0.jsonl") if "judge" in r][-1]
    assert stats["judged"] >= len(trained) and stats["client"]["requests"] >= stats["judged"]
    # Frozen: the learner never attached it (only the policy's replica has weights to compare).
    assert set(summary["replica_weights"]) == {"learner", "actor"}
    assert "judge" in (run_dir / "logs").joinpath("judge.log").read_text()

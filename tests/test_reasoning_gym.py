"""envpool.env = "reasoning_gym" (envpool/envs/tasks/reasoninggym.py): items by seed, a held-out
eval split, rewards from the dataset's own scorer, and bad arguments named before a run."""

from __future__ import annotations

import anyio
import pytest

from millstream.envpool.envs import make_env

pytest.importorskip("reasoning_gym")


def _play(env, seed: int, *replies: str):
    async def go():
        obs = await env.reset(seed)
        results = [await env.step(reply) for reply in replies]
        return obs, results

    return anyio.run(go)


def test_a_seed_plays_one_item_and_is_scored_by_the_datasets_own_scorer():
    env = make_env("reasoning_gym", dict(task="basic_arithmetic", size=1000, eval_items=100))
    obs, [right] = _play(env, 7, f"I think... <answer>{env.dataset[107]['answer']}</answer>")
    assert obs.text == env.dataset[107]["question"] and env.index == 107
    assert right.reward == 1.0 and right.done and right.info["success"] and right.info["valid"]
    again = make_env("reasoning_gym", dict(task="basic_arithmetic", size=1000, eval_items=100))
    assert _play(again, 7)[0].text == obs.text  # a group's members face the same item
    _, [wrong] = _play(env, 7, "<answer>not a number</answer>")
    assert wrong.reward == env.dataset.score_answer("not a number", env.dataset[107]) == 0.0
    _, [untagged] = _play(env, 7, env.dataset[107]["answer"])  # no <answer> tags: no answer
    assert untagged.reward == 0.0 and untagged.info["valid"] is False


def test_a_scorer_that_raises_on_the_model_s_answer_scores_it_zero():
    """prime_factorization's scorer raises on answers such as "2^2 × 3": the answer is the
    model's, so is the failure (0, invalid), not the environment's (an env_error dropped the
    episode from its group, and the model was never told that format was wrong)."""
    env = make_env("reasoning_gym", dict(task="prime_factorization", size=50, eval_items=10))
    _, [odd] = _play(env, 3, "<answer>2^2 × 3</answer>")
    assert odd.reward == 0.0 and odd.info["valid"] is False and not odd.info["success"]
    assert odd.info["score_error"].startswith("ValueError")
    _, [right] = _play(env, 3, f"<answer>{env.dataset[env.item_index(3)]['answer']}</answer>")
    assert right.reward == 1.0 and "score_error" not in right.info


def test_a_final_answer_mode_reads_replies_without_tags():
    env = make_env("reasoning_gym", dict(task="basic_arithmetic", answer="final"))
    _, [right] = _play(env, 5, f"First 2, then... so it is {env.dataset[env.item_index(5)]['answer']}.")
    assert right.reward == 1.0 and right.info["valid"]
    _, [none] = _play(env, 5, "I do not know.")
    assert none.reward == 0.0 and none.info["valid"] is False


def test_the_eval_split_is_held_out_and_walked_in_order():
    train = make_env("reasoning_gym", dict(task="basic_arithmetic", size=1000, eval_items=100))
    held = make_env("reasoning_gym", dict(task="basic_arithmetic", size=1000, eval_items=100, split="eval"))
    assert [held.item_index(s) for s in range(100)] == list(range(100))
    assert {train.item_index(s) for s in range(5000)} == set(range(100, 1000))


def test_feedback_mode_tries_again_until_right():
    env = make_env("reasoning_gym", dict(task="basic_arithmetic", mode="feedback", max_attempts=3))
    answer = None

    async def go():
        nonlocal answer
        await env.reset(3)
        answer = env.item["answer"]
        first = await env.step("<answer>-1.5e99</answer>")
        second = await env.step(f"<answer>{answer}</answer>")
        return first, second

    first, second = anyio.run(go)
    assert not first.done and first.observation.text == "That is not right. Try again."
    assert second.done and second.reward == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        ({"task": "basic_arithmetik"}, "envpool.env_args.task = 'basic_arithmetik': reasoning-gym has no"),
        ({"task_args": {"min_terms": "two"}}, "envpool.env_args.task_args for 'basic_arithmetic'"),
        ({"split": "test"}, "envpool.env_args.split = 'test'"),
        ({"eval_items": 0}, "envpool.env_args.eval_items = 0"),
        ({"answer": "xml"}, "envpool.env_args.answer = 'xml'"),
    ],
)
def test_bad_arguments_name_the_key(args, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        make_env("reasoning_gym", args)

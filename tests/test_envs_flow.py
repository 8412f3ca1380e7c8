"""Rules of the flow-shaping environments (markovian, agentflow) and the cost probes (noop, echo).

The environments are driven directly, not through the episode runner: these tests check what
the environments *say* (rewards, validity, and the Observation fields `trained`, `new_context`,
`carry_tokens` that the runner honours), not how the runner builds contexts from them.
"""

import random
import re

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.envpool.envs import make_env
from millstream.envpool.envs.checks.echo import Echo
from millstream.envpool.envs.checks.noop import Noop
from millstream.envpool.envs.tasks.agentflow import AgentFlow, CalculatorError, calculator, make_question
from millstream.envpool.envs.tasks.markovian import MAX_STEPS, Markovian, make_chain

GARBAGE = "\x00\ufffd<garbage>"  # what the fault injector sends


def play(env, seed, actions):
    """Reset with `seed`, step through `actions`; returns (first observation, step results)."""

    async def go():
        first = await env.reset(seed)
        return first, [await env.step(a) for a in actions]

    return anyio.run(go)


def test_registered_names():
    for name, cls in [("markovian", Markovian), ("agentflow", AgentFlow), ("noop", Noop), ("echo", Echo)]:
        assert type(make_env(name)) is cls


ONE_FILE_ENV = """
from millstream.envpool.envs import Observation, StepResult


class Parrot:
    def __init__(self, word: str = "hi") -> None:
        self.word = word

    async def reset(self, seed: int) -> Observation:
        return Observation(f"Say {self.word}.", anchor="start")

    async def step(self, action: str) -> StepResult:
        right = action.strip() == self.word
        info = {"valid": True, "success": right}
        return StepResult(Observation("", anchor="end"), float(right), True, info)
"""


def test_a_one_file_environment_loads_by_path_without_packaging(tmp_path, monkeypatch):
    path = tmp_path / "parrot.py"
    path.write_text(ONE_FILE_ENV)
    first, [result] = play(make_env(f"{path}:Parrot", {"word": "moo"}), 0, ["moo"])
    assert first.text == "Say moo." and result.reward == 1.0
    monkeypatch.chdir(tmp_path)  # a path relative to the working directory, and module:Class
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(make_env("parrot.py:Parrot")).__name__ == type(make_env("parrot:Parrot")).__name__ == "Parrot"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nowhere.py:Parrot", "no file "),
        ("parrot.py:Crow", "has no 'Crow'"),
        ("parrot.py:ONE", "ONE is not an environment"),
        ("broken.py:Parrot", "failed to load: NameError"),
        ("no_such_module_here:Parrot", "cannot import 'no_such_module_here'"),
    ],
)
def test_a_one_file_environment_that_cannot_load_says_why(tmp_path, monkeypatch, spec, message):
    from millstream.envpool.envs import UnknownEnvironment

    (tmp_path / "parrot.py").write_text(ONE_FILE_ENV + "\nONE = 1\n")
    (tmp_path / "broken.py").write_text("undefined_name\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownEnvironment, match=re.escape(message)):
        make_env(spec)


# -- noop --------------------------------------------------------------------------------------


def test_noop_is_one_valid_turn_worth_nothing():
    first, [result] = play(make_env("noop"), 5, [GARBAGE])
    assert (first.text, first.anchor) == ("Say anything.", "start")
    assert (result.reward, result.done, result.observation.text) == (0.0, True, "")
    assert result.info == {"valid": True, "success": False}
    _, [again] = play(make_env("noop", {"prompt": "Hi."}), 6, ["anything"])
    assert again.info is not result.info  # a fresh dict each step


def test_noop_rejects_bad_prompt():
    with pytest.raises(ValueError, match="prompt.*3"):
        make_env("noop", {"prompt": 3})


# -- echo --------------------------------------------------------------------------------------


def test_echo_rewards_valid_turns_and_keeps_state_on_invalid():
    first, results = play(make_env("echo", {"turns": 3}), 0, ["hello", "\x00bad", "world"])
    assert (first.text, first.anchor) == ("Say something short.", "turn0")
    assert [r.reward for r in results] == [pytest.approx(1 / 3), -0.1, pytest.approx(1 / 3)]
    assert [r.info["valid"] for r in results] == [True, False, True]
    assert [r.done for r in results] == [False, False, True]
    assert [r.observation.anchor for r in results] == ["turn1", "turn2", "turn3"]
    # The invalid reply is not echoed: the quote stays the last valid reply.
    assert results[0].observation.text == "You said: hello\nSay something else."
    assert results[1].observation.text == "You said: hello\nSay something else."
    assert results[2].observation.text == ""


def test_echo_cuts_the_quote():
    _, [result, _] = play(make_env("echo", {"max_echo_chars": 4}), 0, ["abcdefgh", "x"])
    assert result.observation.text == "You said: abcd\nSay something else."
    _, [result, _] = play(make_env("echo", {"max_echo_chars": 0}), 0, ["abc", "x"])
    assert result.observation.text == "You said: \nSay something else."


@pytest.mark.parametrize("reply", ["", "a\ufffdb", "nul\x00", GARBAGE])
def test_echo_invalid_replies(reply):
    _, [result, last] = play(make_env("echo", {"format_penalty": -0.5}), 0, [reply, "fine"])
    assert (result.reward, result.done, result.info["valid"], result.info["success"]) == (
        -0.5,
        False,
        False,
        False,
    )
    assert (last.reward, last.done, last.info["valid"]) == (0.5, True, True)


def test_echo_anchors_follow_the_turn_not_the_text():
    _, a = play(make_env("echo", {"turns": 2}), 9, ["one", "two"])
    _, b = play(make_env("echo", {"turns": 2}), 9, ["other", "\x00"])
    assert [r.observation.anchor for r in a] == [r.observation.anchor for r in b]
    assert a[0].observation.text != b[0].observation.text


@pytest.mark.parametrize(
    "args, bad",
    [
        ({"turns": 0}, "turns"),
        ({"turns": True}, "turns"),
        ({"turns": "2"}, "turns"),
        ({"max_echo_chars": -1}, "max_echo_chars"),
        ({"format_penalty": 0.5}, "format_penalty"),
        ({"format_penalty": "x"}, "format_penalty"),
        ({"prompt": None}, "prompt"),
    ],
)
def test_echo_bad_args(args, bad):
    with pytest.raises(ValueError, match=bad):
        Echo(**args)


# -- markovian ---------------------------------------------------------------------------------

SEED1_QUERY = (
    "Start at 5. Multiply by 2. Subtract 4. Subtract 15. Subtract 13. "
    "What is the result?"
)  # 5*2 = 10, -4 = 6, -15 = -9, -13 = -22


def test_markovian_task_from_seed():
    first, _ = play(env := make_env("markovian"), 1, [])
    assert (first.text, first.anchor, env.answer) == (SEED1_QUERY, "chunk0", -22)
    assert (first.new_context, first.carry_tokens, first.trained) == (False, 0, True)


@pytest.mark.parametrize(
    "reply, reward, success",
    [
        ("<think>10, 6, -9</think><answer>-22</answer>", 1.0, True),
        ("<answer> -022 </answer>", 1.0, True),
        ("<answer>22</answer>", 0.0, False),
    ],
)
def test_markovian_answer_ends_the_episode(reply, reward, success):
    _, [result] = play(make_env("markovian"), 1, [reply])
    assert result.done and result.observation.text == ""
    assert (result.reward, result.info["valid"], result.info["success"]) == (reward, True, success)


def test_markovian_unfinished_chunks_continue_in_a_fresh_context():
    thinking = ["Start at 5, times 2 is 10, minus 4 is", "6, minus 15 is -9", "and then"]
    _, results = play(make_env("markovian", {"carry_tokens": 5}), 1, thinking)
    for k, result in enumerate(results[:2], 1):
        obs = result.observation
        assert (result.reward, result.done, result.info["valid"]) == (0.0, False, True)
        assert (obs.new_context, obs.carry_tokens, obs.trained, obs.anchor) == (True, 5, True, f"chunk{k}")
        assert obs.text == (
            f"{SEED1_QUERY}\nContinue your reasoning from where it stopped (chunk {k + 1} of 3)."
        )
        assert thinking[k - 1] not in obs.text  # the carry-over travels as tokens, not text
    last = results[2]
    assert (last.reward, last.done, last.info["success"], last.info["truncated"]) == (0.0, True, False, True)


def test_markovian_answer_in_a_later_chunk():
    _, results = play(make_env("markovian"), 1, ["10, 6, -9", "<answer>-22</answer>"])
    assert [r.reward for r in results] == [0.0, 1.0]
    assert results[1].done and results[1].info == {"chunk": 2, "valid": True, "success": True}


@pytest.mark.parametrize("content", ["", "about 20", "1.5", "+-22", "1 || 2", "1" * 31, "٣"])
def test_markovian_malformed_answer_is_penalised_and_ends(content):
    _, [result] = play(make_env("markovian"), 1, [f"<answer>{content}</answer>"])
    assert (result.reward, result.done, result.info["valid"], result.info["success"]) == (
        -0.1,
        True,
        False,
        False,
    )


def test_markovian_nul_chunk_is_invalid_but_goes_on():
    _, [result] = play(make_env("markovian"), 1, [GARBAGE + "<answer>-22</answer>"])
    assert (result.reward, result.done, result.info["valid"]) == (-0.1, False, False)
    assert result.observation.new_context
    _, [cut] = play(make_env("markovian", {"max_chunks": 1, "format_penalty": -0.2}), 1, [GARBAGE])
    assert (cut.reward, cut.done, cut.info["valid"], cut.info["truncated"]) == (-0.2, True, False, True)


def test_markovian_tolerates_a_cut_character():
    _, [result] = play(make_env("markovian"), 1, ["ten then six \ufffd"])
    assert (result.reward, result.done, result.info["valid"]) == (0.0, False, True)


def test_markovian_determinism_and_anchors():
    a_first, a = play(make_env("markovian"), 42, ["first idea", "more"])
    b_first, b = play(make_env("markovian"), 42, ["another idea entirely", "else"])
    assert a_first == b_first
    assert [r.observation for r in a] == [r.observation for r in b]  # same chunk, same state key
    assert a[0].observation.anchor != a[1].observation.anchor
    assert len({make_chain(random.Random(s), 4)[0] for s in range(20)}) > 15


@given(seed=st.integers(0, 2**63), steps=st.integers(1, MAX_STEPS))
@settings(max_examples=200, deadline=None)
def test_markovian_chains_are_solvable_and_short(seed, steps):
    query, answer = make_chain(random.Random(seed), steps)
    assert len(query) < 800
    ops = re.findall(r"(Start at|Add|Subtract|Multiply by) (\d+)\.", query)
    assert len(ops) == steps + 1
    value = 0
    for op, n in ops:
        value = {
            "Start at": lambda v, n: n,
            "Add": lambda v, n: v + n,
            "Subtract": lambda v, n: v - n,
            "Multiply by": lambda v, n: v * n,
        }[op](value, int(n))
    assert value == answer


@pytest.mark.parametrize(
    "args, bad",
    [
        ({"steps": 0}, "steps"),
        ({"steps": MAX_STEPS + 1}, "steps"),
        ({"max_chunks": 0}, "max_chunks"),
        ({"carry_tokens": -1}, "carry_tokens"),
        ({"carry_tokens": 2.5}, "carry_tokens"),
        ({"format_penalty": 1}, "format_penalty"),
    ],
)
def test_markovian_bad_args(args, bad):
    with pytest.raises(ValueError, match=bad):
        Markovian(**args)


# -- agentflow ---------------------------------------------------------------------------------

SEED1_QUESTION = "What is 29 * 84 + 99?"  # 29 * 84 = 2436, + 99 = 2535
CALL = "<answer>calculator: 29*84+99</answer>"


def test_agentflow_full_flow_trains_only_the_planner():
    env = make_env("agentflow")
    first, results = play(
        env,
        1,
        [CALL, "<answer>29 * 84 + 99</answer>", "<answer>stop</answer>", "<answer>final: 2535</answer>"],
    )
    assert SEED1_QUESTION in first.text and env.answer == 2535
    assert (first.trained, first.new_context) == (True, False)
    executor, verifier, final, end = (r.observation for r in results)
    assert [o.trained for o in (executor, verifier, final)] == [False, False, True]
    assert all(o.new_context and o.carry_tokens == 0 for o in (executor, verifier, final))
    assert "calculator: 29*84+99" in executor.text and "executor" in executor.text
    assert "1. calculator(29 * 84 + 99) = 2535" in verifier.text
    assert "1. calculator(29 * 84 + 99) = 2535" in final.text
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
    assert [r.done for r in results] == [False, False, False, True]  # 4 turns: max_turns default
    assert results[3].info == {"valid": True, "success": True, "role": "final", "tool_calls": 1}
    assert end.text == ""


def test_agentflow_wrong_final_and_direct_final():
    _, results = play(
        make_env("agentflow"),
        1,
        [CALL, "<answer>29*84</answer>", "<answer>stop</answer>", "<answer>final: 2436</answer>"],
    )
    assert "calculator(29 * 84) = 2436" in results[1].observation.text
    assert (results[3].reward, results[3].done, results[3].info["success"]) == (0.0, True, False)
    _, [direct] = play(make_env("agentflow"), 1, ["<answer>final: 2535</answer>"])
    assert (direct.reward, direct.done, direct.info["tool_calls"]) == (1.0, True, 0)


@pytest.mark.parametrize(
    "reply",
    [
        "I think 2535",
        "<answer>final: about 2500</answer>",
        "<answer>search: 29*84</answer>",
        "<answer>calculator:</answer>",
        "<answer>final: 1 || final: 2</answer>",
        GARBAGE,
        "<answer>final: 2535</answer>\x00",
    ],
)
def test_agentflow_bad_planner_reply_is_penalised_and_asked_again(reply):
    first, [result] = play(make_env("agentflow", {"format_penalty": -0.3}), 1, [reply])
    assert (result.reward, result.done, result.info["valid"]) == (-0.3, False, False)
    assert (result.observation.text, result.observation.anchor) == (first.text, first.anchor)
    assert result.observation.trained and result.observation.new_context


def test_agentflow_final_planner_may_not_call_the_tool():
    _, results = play(
        make_env("agentflow"),
        1,
        [CALL, "<answer>1+1</answer>", "<answer>stop</answer>", CALL, "<answer>final: 2535</answer>"],
    )
    assert (results[3].reward, results[3].info["valid"], results[3].done) == (-0.1, False, False)
    assert results[3].observation.anchor == results[2].observation.anchor
    assert (results[4].reward, results[4].done) == (1.0, True)


def test_agentflow_untrained_modules_are_never_scored():
    _, results = play(
        make_env("agentflow", {"max_rounds": 2}),
        1,
        [CALL, GARBAGE, "hmm", CALL, "<answer>1/0</answer>", "<answer>continue</answer>"],
    )
    executor, verifier = results[1], results[2]
    assert (executor.reward, executor.info["valid"], executor.info["tool"]) == (0.0, False, "no tool result")
    assert (verifier.reward, verifier.info["valid"]) == (0.0, False)
    # Unreadable verdict = continue: round 2 of the planner, with the memory so far.
    planner2 = verifier.observation
    assert planner2.trained and "round 2 of 2" in planner2.text and "1. no tool result" in planner2.text
    assert results[4].info["tool"] == "calculator(1 / 0) failed: division by zero"
    # "continue" in the last round still leads to the final planner.
    final = results[5].observation
    assert final.trained and "final: N" in final.text and "2. calculator(1 / 0) failed" in final.text


def test_agentflow_anchors_are_canonical_flow_states():
    def anchors(executor_reply, seed=1):
        first, results = play(make_env("agentflow"), seed, [CALL, executor_reply])
        return [first.anchor] + [r.observation.anchor for r in results]

    spaced, tight, other = (
        anchors("<answer>29 * 84 + 99</answer>"),
        anchors("<answer>29*84+99</answer>"),
        anchors("<answer>29*84</answer>"),
    )
    assert spaced == tight  # "29*84+99" and "29 * 84 + 99" are one state
    assert spaced[:2] == other[:2] and spaced[2] != other[2]
    assert len(set(spaced)) == 3  # planner, executor, verifier differ
    assert spaced[0] == '["planner",1,"",[]]'
    assert spaced[2] == '["verifier",1,"",["calculator(29 * 84 + 99) = 2535"]]'


def test_agentflow_determinism_and_shared_context_option():
    a, _ = play(make_env("agentflow"), 7, [])
    b, _ = play(make_env("agentflow"), 7, [])
    assert a == b
    assert len({play(make_env("agentflow"), s, [])[0].text for s in range(20)}) > 15
    _, results = play(make_env("agentflow", {"fresh_context": False}), 1, [CALL, "x", "y"])
    assert not any(r.observation.new_context for r in results)
    assert [r.observation.trained for r in results] == [False, False, True]


def test_agentflow_step_after_the_end_is_a_bug():
    env = make_env("agentflow")
    with pytest.raises(RuntimeError, match="ended episode"):
        play(env, 1, ["<answer>final: 1</answer>", "<answer>final: 1</answer>"])


@pytest.mark.parametrize(
    "expr, value",
    [
        ("7/2", "3.5"),
        ("2*(3+4)", "14"),
        ("-3 + +1", "-2"),
        ("0.1+0.2", "0.3"),
        ("1/3", "0.333333"),
        ("(12 + 30) * 2 - 4 / 4", "83"),
        ("6/3", "2"),
    ],
)
def test_calculator_values(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "2**10",
        "__import__('os').system('true')",
        "x",
        "1/0",
        "1e999",
        "1" * 101,
        "\x00",
        "",
        "1,2",
        "3 % 2",
        "[1]",
        "True + 1",
        "1 <= 2",
    ],
)
def test_calculator_refuses(expr):
    with pytest.raises(CalculatorError):
        calculator(expr)


@given(seed=st.integers(0, 2**63))
@settings(max_examples=200, deadline=None)
def test_agentflow_questions_are_solvable_by_the_tool(seed):
    expr, answer = make_question(random.Random(seed))
    assert calculator(expr) == str(answer)  # the executor can always get it exactly
    first, _ = play(make_env("agentflow"), seed, [])
    assert len(first.text) < 800


@pytest.mark.parametrize(
    "args, bad",
    [
        ({"max_rounds": 0}, "max_rounds"),
        ({"max_rounds": 1.0}, "max_rounds"),
        ({"format_penalty": 0.1}, "format_penalty"),
        ({"fresh_context": 1}, "fresh_context"),
    ],
)
def test_agentflow_bad_args(args, bad):
    with pytest.raises(ValueError, match=bad):
        AgentFlow(**args)

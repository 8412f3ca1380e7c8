"""Where `math_answer` (ours: numbers only, exact) and `math_verify` (Hugging Face's math-verify:
symbolic, 6-decimal floats) disagree, and where they agree (envpool/scoring/rewards.py)."""

from __future__ import annotations

import pytest

from millstream.envpool.scoring.rewards import math_answer, math_verify

pytest.importorskip("math_verify")

CASES = [
    # response, reference, math_answer, math_verify
    ("x = 1,234", "1234", True, True),
    ("The total is 1,000,000.", "1000000", True, True),
    ("\\boxed{12}. Then 3 more", "12", True, True),
    ("\\boxed{3}", "3.0", True, True),
    ("-7", "7", False, False),
    ("\\boxed{1.0000001}", "1", False, False),
    # math-verify is right: equal values that are not the same number text.
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", False, True),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", False, True),
    ("\\boxed{\\pi/2}", "1.5707963", False, True),
    # math-verify reads "the answer is": ours takes the last number, 8.
    ("The answer is 7 not 8", "7", False, True),
    # A judgement call: math-verify rounds to 6 decimals, ours is exact.
    ("0.333333", "1/3", False, True),
]


@pytest.mark.parametrize("response, reference, ours, theirs", CASES)
def test_where_the_two_matchers_agree_and_differ(response, reference, ours, theirs):
    assert math_answer(response, reference, {})["success"] is ours
    verified = math_verify(response, reference, {})
    assert verified["success"] is theirs and verified["reward"] == float(theirs)


def test_no_answer_at_all_is_invalid_for_both():
    assert math_verify("I cannot say.", "7", {}) == {"reward": 0.0, "success": False, "valid": False}
    assert math_answer("I cannot say.", "7", {})["valid"] is False


def test_a_reference_the_verifier_cannot_read_fails_the_episode_and_a_response_scores_0(monkeypatch):
    """math-verify catches its own time-out and answers "no match": a reference it could not
    read (in time, or at all) scored every sample 0, the row's fault counted as the model's. It
    now raises (the episode fails as `env_error`). A response it cannot read in time is the
    model's own text: no answer, 0 (an env_error would let a wrong answer out of its 0)."""
    import time

    import math_verify.parser as parser

    from millstream.envpool.scoring import rewards

    monkeypatch.setattr(rewards, "VERIFY_TIMEOUT_S", 1)
    slow_parse = parser.extract_target_from_pred

    def slow(pred, *args, **kwargs):
        if "SLOW" in pred:
            time.sleep(2)  # past the 1 s bound: math-verify's alarm interrupts it
        return slow_parse(pred, *args, **kwargs)

    monkeypatch.setattr(parser, "extract_target_from_pred", slow)
    with pytest.raises(RuntimeError, match="did not finish the reference in its 1 s bound"):
        math_verify("\\boxed{7}", "\\boxed{7} SLOW", {})
    assert math_verify("SLOW \\boxed{7}", "7", {}) == {"reward": 0.0, "success": False, "valid": False}
    with pytest.raises(ValueError, match="reads no answer in the reference"):
        math_verify("\\boxed{7}", "", {})
    assert math_verify("\\boxed{7}", "7", {})["success"]  # the verifier itself still works


@pytest.mark.parametrize(
    "response, reference, matches",
    [
        ("\\boxed{\\sqrt{5}}", "5", False),  # the last number of an expression is not its value
        ("\\boxed{2^{10}}", "10", False),
        ("\\boxed{5\\sqrt{2}}", "2", False),
        ("\\boxed{3/4/5}", "5", False),
        ("\\boxed{\\frac{1}{0}}", "0", False),
        ("\\boxed{-\\frac{1}{2}}", "-1/2", True),
        ("\\boxed{x=\\frac{1}{2}}", "1/2", True),
        ("\\boxed{\\frac34}", "3/4", True),
        ("\\boxed{7{,}000}", "7000", True),
        ("\\boxed{\u22127}", "-7", True),  # a Unicode minus
        ("\\boxed{4\\text{ cm}}", "4", True),
        ("\\boxed{x = {4}}", "4", True),
        ("\\boxed{\\$18.90}", "18.90", True),  # currency, percent, degrees, a thin space: GSM8K, MATH
        ("\\boxed{18\\%}", "18", True),
        ("\\boxed{30^\\circ}", "30", True),
        ("\\boxed{5\\,\\text{cm}}", "5", True),
        ("\\boxed{10^2}", "10", False),
    ],
)
def test_math_answer_credits_the_number_an_answer_states(response, reference, matches):
    """`math_answer` took the last number inside a boxed expression it could not read as one:
    `\\boxed{\\sqrt{5}}` earned the reward for 5. A box now answers with a number only when it
    states one (a name, units, braces around it at most)."""
    assert math_answer(response, reference, {})["success"] is matches


@pytest.mark.timeout(60)  # the quadratic patterns took minutes on this box (40 s at 64,000)
def test_a_long_box_is_answered_without_reading_it_through():
    """The patterns around a stated number took quadratic time on a long box (a degenerate reply
    inside `\\boxed{`: 3 s for 16,000 characters, in the worker's event loop); a box longer than
    any stated number is now no number at once."""
    assert math_answer("\\boxed{" + "x " * 200_000 + "!}", "4", {})["reward"] == 0.0

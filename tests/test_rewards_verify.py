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

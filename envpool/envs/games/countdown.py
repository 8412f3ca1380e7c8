"""Countdown as in TinyZero: combine the given numbers into an expression equal to the target.

The seed draws 3 or 4 numbers (`min_numbers`..`max_numbers`) from 1..`max_number` (default 99)
and builds the target from them, so it is always reachable: the numbers, shuffled, are folded
left to right with random operations among + - * / that keep every intermediate result a
positive integer (either operand order for - and /), and a target outside 1..`max_target`
(default 100, TinyZero's range) is drawn again.

One turn. The answer is an arithmetic expression, `<answer>(44 + 19) + 35</answer>`, using each
given number exactly once (TinyZero's rule), binary + - * / and parentheses only: no unary minus,
no other numbers, no names. It is parsed with `ast` and only those nodes are allowed; it is
never passed to eval. Values are exact fractions, so 7 / 2 * 2 is 7.

Rewards (TinyZero's `compute_score`): 1.0 when the value equals the target (success); a
well-formed expression that misuses the numbers, divides by zero or misses the target gets
`format_score` (default 0.1), with `valid=True`; no answer block, or an answer that is not such
an expression, gets `format_penalty` (default 0.0, TinyZero's score for an unparseable answer)
with `valid=False`. Anchors: "start", then "done".
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction

from millstream.envpool.envs.base import Observation, StepResult, register

__all__ = ["Countdown", "make_task", "parse_expression", "used_numbers", "evaluate"]

#: Longer answers are refused before parsing: deep nesting would exhaust the parser's recursion.
MAX_ANSWER_CHARS = 200

_CHARS = re.compile(r"[\d+\-*/()\s]+", re.ASCII)
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def make_task(
    rng: random.Random, min_numbers: int, max_numbers: int, max_number: int, max_target: int
) -> tuple[list[int], int, str]:
    """(numbers, target, one solution) with the target reachable from the numbers."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        order = list(numbers)
        rng.shuffle(order)
        value, expr = order[0], str(order[0])
        for x in order[1:]:
            # Fully parenthesised, so the solution reads right whatever the precedence.
            choices = [(value + x, f"({expr} + {x})"), (value * x, f"({expr} * {x})")]
            if value > x:
                choices.append((value - x, f"({expr} - {x})"))
            if x > value:
                choices.append((x - value, f"({x} - {expr})"))
            if value % x == 0:
                choices.append((value // x, f"({expr} / {x})"))
            if x % value == 0:
                choices.append((x // value, f"({x} / {expr})"))
            value, expr = rng.choice(choices)
        if 1 <= value <= max_target:
            return numbers, value, expr


def parse_expression(text: str) -> ast.expr | None:
    """The expression's syntax tree if it is only int literals, + - * / and parentheses."""
    # TinyZero's character whitelist, less the dot: refuses names, hex and 1_000 literals early.
    if len(text) > MAX_ANSWER_CHARS or not _CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: NUL bytes in the source
        return None

    def allowed(node: ast.AST) -> bool:
        if isinstance(node, ast.BinOp):
            return type(node.op) in _OPS and allowed(node.left) and allowed(node.right)
        # bool is an int subclass, and True/False are Constants: refuse them explicitly.
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0

    return tree.body if allowed(tree.body) else None


def used_numbers(node: ast.expr) -> list[int]:
    if isinstance(node, ast.BinOp):
        return used_numbers(node.left) + used_numbers(node.right)
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return [node.value]


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a tree accepted by `parse_expression`; ZeroDivisionError on x / 0."""
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int)  # parse_expression admits integer literals only
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    left, right = evaluate(node.left), evaluate(node.right)
    op = _OPS[type(node.op)]
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left / right


@register("countdown")
class Countdown:
    system_prompt = (
        "Combine the given numbers into an expression equal to the target. Use every "
        "number exactly once, with + - * / and parentheses. "
        "Answer like <answer>(1 + 2) * 3</answer>."
    )

    def __init__(
        self,
        min_numbers: int = 3,
        max_numbers: int = 4,
        max_number: int = 99,
        max_target: int = 100,
        format_score: float = 0.1,
        format_penalty: float = 0.0,
    ) -> None:
        if not isinstance(min_numbers, int) or not 2 <= min_numbers <= 6:
            raise ValueError(f"min_numbers must be an integer in [2, 6], got {min_numbers!r}")
        if not isinstance(max_numbers, int) or not min_numbers <= max_numbers <= 6:
            raise ValueError(f"max_numbers must be an integer in [min_numbers, 6], got {max_numbers!r}")
        if not isinstance(max_number, int) or not 2 <= max_number <= 1000:
            raise ValueError(f"max_number must be an integer in [2, 1000], got {max_number!r}")
        if not isinstance(max_target, int) or max_target < 1:
            raise ValueError(f"max_target must be an integer >= 1, got {max_target!r}")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        self.format_score, self.format_penalty = format_score, format_penalty
        self.numbers: list[int] = []
        self.target = 0
        self.solution = ""  # one expression reaching the target (for tests and debugging)
        self._done = True

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self.numbers, self.target, self.solution = make_task(
            rng, self.min_numbers, self.max_numbers, self.max_number, self.max_target
        )
        self._done = False
        listed = ", ".join(map(str, self.numbers))
        return Observation(f"Numbers: {listed}. Target: {self.target}.", anchor="start")

    async def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        self._done = True
        done = Observation("", anchor="done")
        tree = self._parse(action)
        if tree is None:
            return StepResult(done, self.format_penalty, True, {"valid": False, "success": False})
        if sorted(used_numbers(tree)) != sorted(self.numbers):
            return StepResult(
                done, self.format_score, True, {"valid": True, "success": False, "numbers_ok": False}
            )
        try:
            value = evaluate(tree)
        except ZeroDivisionError:
            value = None
        success = value == self.target
        reward = 1.0 if success else self.format_score
        return StepResult(done, reward, True, {"valid": True, "success": success, "numbers_ok": True})

    @staticmethod
    def _parse(action: str) -> ast.expr | None:
        # The last answer block counts, as in TinyZero's extract_solution; "||" has no meaning here.
        start = action.rfind("<answer>")
        if start < 0:
            return None
        end = action.find("</answer>", start)
        if end < 0:
            return None
        return parse_expression(action[start + len("<answer>") : end])

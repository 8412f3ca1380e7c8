"""An AgentFlow-style flow: a trained planner, and an executor and a verifier that are not trained.

After AgentFlow (Li et al. 2025, "In-the-Flow Agentic System Optimization for Effective
Planning and Tool Use"): modules Planner -> Executor -> Verifier share an evolving memory, loop
for up to `max_rounds` rounds, and the planner gives the final solution. Flow-GRPO trains the
planner only, on the final outcome broadcast to each of its turns. Here the same policy plays
every module; the observation that asks the planner has `trained=True`, the ones that ask the
executor and the verifier have `trained=False` (the runner generates those replies but masks
their tokens out of the loss).

The task: an arithmetic question drawn from the seed, "What is 37 * 24 - 158?" (two-digit
factors, so a small model gains from the tool), with one integer answer.

The flow, one turn per module call:
1. planner: `<answer>calculator: EXPR</answer>` (go to the executor) or
   `<answer>final: N</answer>` (the episode ends);
2. executor, shown the planner's request: `<answer>EXPR</answer>`, the exact tool call. The
   environment evaluates EXPR with `calculator` (numbers, + - * /, unary signs and parentheses,
   through `ast` and exact fractions, never `eval`) and appends the result, or the tool's error,
   to the memory;
3. verifier: `<answer>stop</answer>` (go to the final planner) or `<answer>continue</answer>`
   (back to 1 for the next round; after `max_rounds` rounds, to the final planner anyway);
4. final planner: `<answer>final: N</answer>`; the episode ends.

Rewards (Flow-GRPO): the outcome, 1.0 if N is the answer (`success=True`) else 0.0, on the turn
that ends the episode; every other well-formed turn earns 0.0. The learner's
`reward_level = "trajectory"` broadcasts the return to the trained (planner) turns. A planner
reply that cannot be read (no answer tag, no "calculator:"/"final:" head, a non-integer N, a
calculator request from the final planner, a NUL) gets `format_penalty` (default -0.1) and
`valid=False`, and the planner is asked again with the state unchanged (as in RAGEN). Executor
and verifier replies are never scored, as they are not trained: one that cannot be read counts
as "no tool result" (memory records that) or as "continue", with reward 0.0; `valid=False`
still reports the bad form, for statistics.

Turns and `envpool.max_turns`: the runner cuts an episode at `max_turns` turns (default 4),
retries included. A flow of R rounds takes 3R + 1 turns when every reply is well formed, so the
default `max_rounds=1` (planner, executor, verifier, final planner) fits in the default 4; for
more rounds set `envpool.max_turns` to 3R + 1 plus room for retries (e.g. 8 for R = 2). A cut
episode is truncated (it earned no outcome reward), not failed.

Contexts: with `fresh_context=True` (default) every observation after the first (which opens a
context anyway) has `new_context=True` and `carry_tokens=0`: each module call sees the system
prompt and its own observation (the question and the memory) only, as AgentFlow prompts each
module from the shared memory, and Flow-GRPO trains each planner turn as its own single-turn
sample. With False the modules share one growing chat (the context grows with every turn).

Anchors: the flow state as compact JSON, [role, round, pending plan, memory], with expressions
normalised by `ast.unparse` (so "37*24" and "37 * 24" are the same state). Members of a group
that planned and computed the same thing share anchors; the reply texts do not enter it.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from fractions import Fraction

from millstream.envpool.envs.base import Observation, StepResult, parse_answer, register

__all__ = ["AgentFlow", "CalculatorError", "calculator", "make_question"]

#: The calculator refuses longer expressions: bounds the work and the size of its numbers.
MAX_EXPR_CHARS = 100
_INTEGER = re.compile(r"[+-]?[0-9]{1,30}")  # capped: int() of a huge digit string raises
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator accepts, or has no finite value."""


def _value(node: ast.AST) -> Fraction:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        if not math.isfinite(node.value):  # "1e999" parses to inf
            raise CalculatorError("number out of range")
        return Fraction(repr(node.value))  # "0.1" stays 1/10, not its binary approximation
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise CalculatorError("only numbers, + - * / and parentheses are allowed")


def calculator(expr: str) -> str:
    """The tool: evaluate arithmetic exactly, "7/2" -> "3.5", "2*(3+4)" -> "14".

    Raises CalculatorError for anything else (names, calls, powers, too long, division by zero).
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression") from None
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    try:
        return f"{float(value):.6g}"
    except OverflowError:
        raise CalculatorError("number out of range") from None


def _normalise(expr: str) -> str:
    """A canonical spelling: `ast.unparse` where it parses, else the words single-spaced."""
    try:
        text = ast.unparse(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        text = " ".join(expr.split())
    return text[: MAX_EXPR_CHARS + 20]


def make_question(rng: random.Random) -> tuple[str, int]:
    """An expression over two-digit numbers with +, - and *, and its integer value."""
    a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 99)
    form = rng.randrange(4)
    if form == 0:
        return f"{a} * {b} + {c}", a * b + c
    if form == 1:
        return f"{a} * {b} - {c}", a * b - c
    if form == 2:
        return f"({a} + {c}) * {b}", (a + c) * b
    return f"{a} * ({b} - {c})", a * (b - c)


def _single_answer(action: str) -> str | None:
    """The one action of the reply's answer block; None if absent, several, or a NUL is sent."""
    if "\x00" in action:
        return None
    answer = parse_answer(action)
    return answer[0] if answer is not None and len(answer) == 1 else None


def _read_plan(action: str) -> tuple[str, str] | None:
    """("calculator", EXPR) or ("final", N) from a planner reply, None if it cannot be read."""
    answer = _single_answer(action)
    if answer is None:
        return None
    head, colon, body = answer.partition(":")
    head, body = head.strip().lower(), body.strip()
    if not colon or not body:
        return None
    if head == "calculator" or (head == "final" and _INTEGER.fullmatch(body)):
        return head, body
    return None


@register("agentflow")
class AgentFlow:
    system_prompt = (
        "You take turns as the planner, the executor or the verifier of an agent; "
        "each message says which. Think briefly, then reply inside "
        "<answer>...</answer>."
    )

    def __init__(self, max_rounds: int = 1, format_penalty: float = -0.1, fresh_context: bool = True) -> None:
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be an integer >= 1, got {max_rounds!r}")
        if (
            isinstance(format_penalty, bool)
            or not isinstance(format_penalty, (int, float))
            or not format_penalty <= 0
        ):
            raise ValueError(f"format_penalty must be a number <= 0, got {format_penalty!r}")
        if not isinstance(fresh_context, bool):
            raise ValueError(f"fresh_context must be true or false, got {fresh_context!r}")
        self.max_rounds, self.format_penalty = max_rounds, float(format_penalty)
        self.fresh_context = fresh_context
        self.question, self.answer = "", 0
        self._role = "done"  # planner | executor | verifier | final | done
        self._round = 1
        self._plan = ""  # the planner's pending calculator request, for the executor
        self._memory: list[str] = []

    async def reset(self, seed: int) -> Observation:
        expr, self.answer = make_question(random.Random(seed))
        self.question = f"What is {expr}?"
        self._role, self._round, self._plan, self._memory = "planner", 1, "", []
        return self._observe(first=True)

    async def step(self, action: str) -> StepResult:
        role = self._role
        if role in ("planner", "final"):
            return self._planner_step(role, action)
        if role == "executor":
            return self._executor_step(action)
        if role == "verifier":
            return self._verifier_step(action)
        raise RuntimeError("step() called on an ended episode; call reset() first")

    def _planner_step(self, role: str, action: str) -> StepResult:
        plan = _read_plan(action)
        if plan is None or (role == "final" and plan[0] != "final"):
            return StepResult(
                self._observe(), self.format_penalty, False, {"valid": False, "success": False, "role": role}
            )
        kind, body = plan
        if kind == "final":
            right = int(body) == self.answer
            self._role = "done"
            return StepResult(
                Observation("", anchor="done"),
                1.0 if right else 0.0,
                True,
                {"valid": True, "success": right, "role": role, "tool_calls": len(self._memory)},
            )
        self._plan, self._role = body, "executor"
        return StepResult(self._observe(), 0.0, False, {"valid": True, "success": False, "role": role})

    def _executor_step(self, action: str) -> StepResult:
        call = _single_answer(action)
        if call is None:
            entry = "no tool result"
        else:
            try:
                entry = f"calculator({_normalise(call)}) = {calculator(call)}"
            except CalculatorError as exc:
                entry = f"calculator({_normalise(call)}) failed: {exc}"
        self._memory.append(entry)
        self._plan, self._role = "", "verifier"
        return StepResult(
            self._observe(),
            0.0,
            False,
            {"valid": call is not None, "success": False, "role": "executor", "tool": entry},
        )

    def _verifier_step(self, action: str) -> StepResult:
        verdict = (_single_answer(action) or "").strip().lower()
        if verdict == "stop" or self._round >= self.max_rounds:
            self._role = "final"
        else:  # "continue", and anything unreadable: the verifier is not trained, never scored
            self._role, self._round = "planner", self._round + 1
        return StepResult(
            self._observe(),
            0.0,
            False,
            {"valid": verdict in ("stop", "continue"), "success": False, "role": "verifier"},
        )

    def _observe(self, first: bool = False) -> Observation:
        memory = "\n".join(f"{i}. {entry}" for i, entry in enumerate(self._memory, 1)) or "(empty)"
        context = f"Question: {self.question}\nMemory:\n{memory}\n"
        if self._role == "planner":
            text = (
                f"{context}You are the planner (round {self._round} of {self.max_rounds}). "
                "Reply <answer>calculator: EXPR</answer> to use the calculator, or "
                "<answer>final: N</answer> to give the integer answer."
            )
        elif self._role == "executor":
            text = (
                f"Question: {self.question}\nThe planner asked for: calculator: "
                f"{self._plan[:MAX_EXPR_CHARS]}\nYou are the executor. Write the exact "
                "calculator call (numbers, + - * / and parentheses) as <answer>EXPR</answer>."
            )
        elif self._role == "verifier":
            text = (
                f"{context}You are the verifier. Is the memory enough to answer the question? "
                "Reply <answer>stop</answer> or <answer>continue</answer>."
            )
        else:
            text = f"{context}You are the planner. Give the integer answer as <answer>final: N</answer>."
        plan = _normalise(self._plan) if self._plan else ""
        anchor = json.dumps(
            [self._role, self._round, plan, self._memory], separators=(",", ":"), ensure_ascii=False
        )
        return Observation(
            text,
            anchor=anchor,
            trained=self._role in ("planner", "final"),
            new_context=self.fresh_context and not first,
        )

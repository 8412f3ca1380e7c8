"""Reward functions for the `dataset` environment, and the math-answer matcher they share.

A reward function scores one response against the row's reference answer:

    def reward(response: str, answer: str, row: dict) -> float | dict

It returns a float, or a dict with at least `reward` (a float) and optionally `success` (a
bool) and any other JSON-able details (kept in the step's `info`). It is named in config as
`envpool.env_args.reward = "module:function"`; this module's `math_answer` is the default. A
function that raises, or returns something that is not a finite number, ends its episode as the
counted cause `env_error` (envpool/episode.py): a broken reward is never scored as 0.

`math_answer` extracts the final answer the way math RL recipes do: the content of the last
`\\boxed{...}` if the response has one, else the last number in the text; then compares it with
the reference as a number, exactly (fractions, not floats): "1,234", "1234.0", "2/4" and
`\\frac{1}{2}` are the numbers they look like. A box answers with a number only when it states
one, with a name, units or braces around it at most ("x = 4", "4 cm"): `\\sqrt{5}` is not 5. A
reference that is not a number is compared as stripped text.

`math_verify` is Hugging Face's verifier (the `math-verify` package, in the `real` extra): it
parses LaTeX and expressions with sympy and compares them symbolically, so `2\\sqrt{2}` equals
`\\sqrt{8}`, `\\{1,2\\}` equals `\\{2,1\\}`, and "The answer is 7, not 8" is 7, where
`math_answer` (numbers only, last number wins) says no to all three; it also accepts floats
equal to 6 decimals (0.333333 for 1/3), which `math_answer`'s exact comparison refuses.
tests/test_rewards_verify.py holds the cases where the two disagree. Use `math_verify` for a
real model's math; `math_answer` stays the default because it needs nothing installed and is
exact on the integer answers of the shipped arithmetic set.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = [
    "math_answer",
    "math_verify",
    "extract_answer",
    "parse_number",
    "labelled_number",
    "answers_match",
    "boxed_content",
]

#: math-verify's bound on each of its parses and its comparison, seconds (its own default).
VERIFY_TIMEOUT_S = 5

#: Longest text a number may be parsed from: Fraction("1" * 100_000) is slow, and no answer is it.
MAX_NUMBER_CHARS = 64

_NUMBER = re.compile(
    r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+",
    re.ASCII,
)
_FRAC = re.compile(r"(-?)\\[dt]?frac(?:\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}|(\d)(\d))")
# What may stand around the one number of a boxed answer: a name ("x = "), units ("cm",
# "\\text{ cm}"), braces or a \\text{} around it. Anything else (an operator, a root, a power,
# a second number) makes it another expression, which no number of it answers.
_LABEL = re.compile(r"[A-Za-z]\w*\s*=\s*")
_CURRENCY = re.compile(r"\\?\$\s*")
_UNITS = re.compile(
    r"(?:\s*(?:\\[,;: ]\s*)?(?:\\(?:text|mathrm)\s*\{[A-Za-z .]*\}|[A-Za-z]+)(?:\^\{?2\}?|\^\{?3\}?)?"
    r"|\s*\\?%|\s*\^\s*\{?\\circ\}?|\s*°)+\.?$"
)
_WRAPPED = re.compile(r"(?:\\(?:text|textbf|mathrm|mathbf)\s*)?\{(.*)\}", re.DOTALL)
_BOXED = "\\boxed{"


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces inside balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed: not a box (the last number then counts)


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number if it is one: "-3", "1,234", "2.50", "3/4", "\\frac{3}{4}",
    with optional "$", spaces and a trailing "."; None for anything else."""
    s = text.strip().strip("$").strip().rstrip(".").strip().replace("\u2212", "-").replace("{,}", ",")
    frac = _FRAC.fullmatch(s)
    if frac:
        sign, num, den = (
            frac.group(1),
            int(frac.group(2) or frac.group(4)),
            int(frac.group(3) or frac.group(5)),
        )
        return (-1 if sign else 1) * Fraction(num, den) if den else None
    if len(s) > MAX_NUMBER_CHARS or not _NUMBER.fullmatch(s):
        return None
    s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response: str) -> str | None:
    """The final answer in a response: the last boxed content, else the last number; None if
    neither is there."""
    boxed = boxed_content(response)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def labelled_number(text: str) -> Fraction | None:
    """The number a boxed answer states, if it states one: "4", "x = 4", "{4}", "4 cm",
    "\\text{4}", "x=\\frac{1}{2}", "\\$18.90", "18\\%", "30^\\circ", "5\\,\\text{cm}"; None for
    any other expression ("\\sqrt{5}", "2^{10}", "5\\sqrt{2}", "3/4/5"), whose last number is not
    its value. A unit, a percent sign or a degree is dropped, not applied: "18\\%" is 18."""
    if len(text) > 4 * MAX_NUMBER_CHARS:  # no stated number is that long (and the patterns stay fast)
        return None
    s = _LABEL.sub("", text.strip(), count=1)
    s = _CURRENCY.sub("", s, count=1) if _CURRENCY.match(s) else s
    s = _UNITS.sub("", s).strip()
    while (wrapped := _WRAPPED.fullmatch(s)) is not None:
        s = wrapped.group(1).strip()
    return parse_number(s)


def answers_match(given: str, reference: str) -> bool:
    """Numbers compare exactly as numbers (`labelled_number`); anything else as stripped text."""
    ref = parse_number(reference)
    if ref is not None:
        return labelled_number(given) == ref
    return given.strip() == reference.strip()


def math_answer(response: str, answer: str, row: dict[str, Any]) -> dict[str, Any]:
    """1.0 if the response's final answer equals `answer` (see the module docstring), else 0.0.

    `valid` says whether the response had an answer at all (a boxed one or a number), which
    the envpool counts as invalid actions."""
    given = extract_answer(response)
    success = given is not None and answers_match(given, str(answer))
    return {"reward": 1.0 if success else 0.0, "success": success, "valid": given is not None}


def math_verify(response: str, answer: str, row: dict[str, Any]) -> dict[str, Any]:
    """1.0 if Hugging Face's math-verify finds the response's answer equal to `answer`.

    The reference is read as LaTeX (wrapped in `$...$` unless it has its own delimiters or a
    box). math-verify bounds its own parsing and comparison with a 5 s alarm (SIGALRM, so only
    in a process's main thread, where the envpool runs environments). A reference it cannot read
    in time, or reads no answer in, raises (the episode fails as `env_error`: the row's fault is
    no reward of 0); a response it cannot read, or not in time, has no answer (0, `valid`
    False): the text is the model's, and an env_error would let a wrong answer out of its 0."""
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        raise ValueError("the math_verify reward needs math-verify: pip install 'millstream[real]'") from None
    reference = str(answer)
    try:
        bound = {"parsing_timeout": VERIFY_TIMEOUT_S, "raise_on_error": True}
        gold = parse(reference if ("$" in reference or "\\boxed" in reference) else f"${reference}$", **bound)
        if not gold:  # the row's fault, not the model's: never a reward of 0
            raise ValueError(f"math-verify reads no answer in the reference {reference[:80]!r}")
    except TimeoutException:  # its bound, on the row's own answer: not the model's doing
        raise RuntimeError(
            f"math-verify did not finish the reference in its {VERIFY_TIMEOUT_S} s bound"
        ) from None
    try:
        given = parse(response, **bound)
        success = bool(given) and bool(
            verify(gold, given, timeout_seconds=VERIFY_TIMEOUT_S, raise_on_error=True)
        )
    except (Exception, TimeoutException):  # the model's answer, malformed or too slow to read: its own
        given, success = [], False  # (an env_error would drop it from its group: a way out of a 0)
    return {"reward": 1.0 if success else 0.0, "success": success, "valid": bool(given)}

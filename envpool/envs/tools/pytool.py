"""Tool-integrated reasoning: answer a computational question, running Python as a tool.

In the style of ToRL (Li et al. 2025, "ToRL: Scaling Tool-Integrated RL", arXiv:2503.23383),
ReTool (Feng et al. 2025, arXiv:2504.11536) and SimpleTIR (2025): the model interleaves its
reasoning with code, the environment runs the code and answers with its output. Each turn the
first complete tag of the reply decides:

- `<python>code</python>`: the code runs in a sandboxed subprocess (below) and the environment
  answers `<output>stdout and stderr</output>`, cut to `max_output_chars` (the start and the end
  are kept); an uncaught exception shows as `line N: Type: message`, a run over the time limit
  as a TimeoutError line. Reward 0, the episode goes on. At most `max_runs` (default 3) runs: a
  later one gets `valid=False`, the format penalty and a reminder to answer, and changes nothing.
- `<answer>X</answer>`: the episode ends; reward 1.0 when X is the right integer (spaces,
  commas, underscores, a final period and `\\boxed{}` are ignored), else 0.0.
- Neither tag, or empty code: `valid=False`, reward `format_penalty` (default -0.1), state
  unchanged, the episode goes on.

The seed picks a task (`random.Random(seed)`): one of the `templates` (default all) with random
parameters, e.g. "What is the sum of the digits of 37**11?", "How many primes are there below
12345?"; the ground truth is computed here, in-process, at reset.

The sandbox (`run_python`, envpool/envs/tools/sandbox/run.py): `python -I -S child.py` (stdlib
only) with an almost empty environment and the code on stdin, locked into new namespaces before
the code runs. `sandbox` (default "strict") picks how, and the constructor refuses a mode that
this machine cannot provide, naming what is missing and the opt-out:
- "strict": "namespaces" when millstream runs as root, else "userns";
- "namespaces" (root): mount, PID, network, IPC and UTS namespaces; the code runs as uid 65534
  (nobody) with no capabilities;
- "userns" (a normal user): the same inside an unprivileged user namespace mapping the user to
  itself, every capability dropped;
- "weak": rlimits and an audit hook only, NOT a security boundary (code you trust).
In the first three the code has no network (a fresh namespace with loopback down), sees a
read-only root of system directories with one writable tmpfs working directory (no checkout, no
run directory, no keys), nothing it forks outlives the call (its PID namespace dies with it), and
a seccomp filter denies it namespaces, mounts, ptrace, bpf and the like.
In all modes: address space (`memory_mb`, default 256), CPU seconds (`cpu_s`), size of written
files, open files; the parent enforces the wall clock (`timeout_s`, default 5 s) and reads at
most `max_output_bytes`. Where this process can make cgroups (`cgroup`: "auto", "off", or a
delegated cgroup v2 directory), each call gets its own, and its processes *together* hold at
most `memory_mb` (a run over it shows "killed: its processes together went over ..."),
`max_processes` (default 64 processes and threads; one past it fails to start) and `cpus`
(default 1.0). Where there is no
cgroup or no seccomp, the constructor logs one line saying so (at preflight) and runs on. An
audit hook (PEP 578) refuses sockets ("network access is disabled in this sandbox"), process
creation and ctypes with clear messages: for honest code, since hostile code can remove it; the
namespaces are what hold.

At most `max_concurrent` (default 8) sandboxes run at once per event loop (an
`anyio.CapacityLimiter` made lazily per loop, shared by all environments with the same limit),
so 10,000 concurrent episodes do not fork 10,000 interpreters; the others wait their turn (the
wait counts in envpool.step_timeout_s).

Anchor: `<task key>|r<runs>|<digest of the outputs seen>`, e.g. `digit_sum:37,11|r1|4be0f1a2c3`:
the task, the runs left, and what the tool showed (two episodes whose different code printed the
same thing are in the same state). After the answer: `<task key>|answered`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from millstream.envpool.envs.base import Observation, StepResult, register
from millstream.envpool.envs.tools.sandbox import (
    SANDBOX_MODES,
    RunResult,
    SandboxUnavailable,
    check_cgroup,
    mechanism_for,
    missing_limits,
    run_python,
)

log = logging.getLogger(__name__)
_WARNED_MISSING: set[str] = set()  # one line per process, however many environments are made

# run_python and RunResult live in sandbox/run.py; re-exported here, where tool users look first.
__all__ = ["PyTool", "Task", "TEMPLATES", "make_task", "run_python", "RunResult", "parse_integer"]
_ACTION = re.compile(r"<(python|answer)>(.*?)</\1>", re.S)
_FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n?(.*?)\n?\s*```\s*$", re.S)
_INVALID = (
    "Invalid reply. Run code with <python>code</python> (print what you need), or give the "
    "final answer with <answer>number</answer>."
)


@dataclass(frozen=True)
class Task:
    key: str  #: compact and canonical, used in anchors: "template:params"
    question: str
    answer: int


def _count_primes_below(n: int) -> int:
    sieve = bytearray([1]) * n  # sieve of Eratosthenes; n >= 2
    sieve[0:2] = b"\x00\x00"
    for p in range(2, math.isqrt(n - 1) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytes(len(range(p * p, n, p)))
    return sum(sieve)


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _fibonacci_mod(n: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return a


def _divisor_sum(n: int) -> int:
    total = 0
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            total += d + (n // d if d * d != n else 0)
    return total


def _digit_sum(rng: random.Random) -> Task:
    a, b = rng.randint(12, 99), rng.randint(11, 40)
    return Task(f"digit_sum:{a},{b}", f"What is the sum of the digits of {a}**{b}?", sum(map(int, str(a**b))))


def _prime_count(rng: random.Random) -> Task:
    n = rng.randint(1000, 30000)
    return Task(f"prime_count:{n}", f"How many primes are there below {n}?", _count_primes_below(n))


def _pow_mod(rng: random.Random) -> Task:
    a, b, m = rng.randint(100, 999), rng.randint(10**5, 10**6), rng.randint(1000, 99999)
    return Task(f"pow_mod:{a},{b},{m}", f"What is {a}**{b} mod {m}?", pow(a, b, m))


def _collatz(rng: random.Random) -> Task:
    n = rng.randint(1000, 99999)
    return Task(
        f"collatz:{n}",
        f"How many steps does the Collatz sequence starting at {n} take to reach 1?",
        _collatz_steps(n),
    )


def _fib_mod(rng: random.Random) -> Task:
    n, m = rng.randint(200, 5000), rng.randint(1000, 99999)
    return Task(f"fib_mod:{n},{m}", f"With F(1) = F(2) = 1, what is F({n}) mod {m}?", _fibonacci_mod(n, m))


def _divisors(rng: random.Random) -> Task:
    n = rng.randint(10_000, 999_999)
    return Task(f"divisor_sum:{n}", f"What is the sum of all positive divisors of {n}?", _divisor_sum(n))


TEMPLATES: dict[str, Callable[[random.Random], Task]] = {
    "digit_sum": _digit_sum,
    "prime_count": _prime_count,
    "pow_mod": _pow_mod,
    "collatz": _collatz,
    "fib_mod": _fib_mod,
    "divisor_sum": _divisors,
}


def make_task(seed: int, templates: tuple[str, ...] = tuple(TEMPLATES)) -> Task:
    rng = random.Random(seed)
    return TEMPLATES[templates[rng.randrange(len(templates))]](rng)


def parse_integer(text: str) -> int | None:
    """The integer an answer states ("1,234", " 1234. ", "\\boxed{1234}", "1234.0"), else None."""
    text = text.strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", text, re.S)
    if boxed:
        text = boxed.group(1)
    text = re.sub(r"[\s,_]", "", text).rstrip(".")
    match = re.fullmatch(r"([+-]?\d+)(?:\.0*)?", text)
    return int(match.group(1)) if match else None


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head - 5
    return f"{text[:head]}\n...\n{text[-tail:]}"


@register("pytool")
class PyTool:
    system_prompt = (
        "Solve the problem. You may run Python by writing <python>code</python>; the printed output "
        "comes back inside <output></output>. Give the final answer as <answer>number</answer>."
    )

    def __init__(
        self,
        templates: list[str] | None = None,
        max_runs: int = 3,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: int = 256,
        max_output_bytes: int = 16384,
        max_output_chars: int = 300,
        max_concurrent: int = 8,
        format_penalty: float = -0.1,
        sandbox: str = "strict",
        max_processes: int = 64,
        cpus: float = 1.0,
        cgroup: str = "auto",
    ) -> None:
        chosen = tuple(templates) if templates is not None else tuple(TEMPLATES)
        unknown = [t for t in chosen if t not in TEMPLATES]
        if not chosen or unknown:
            raise ValueError(f"templates must be a non-empty list of {sorted(TEMPLATES)}, got {templates!r}")
        checks = [
            ("max_runs", max_runs, 0),
            ("cpu_s", cpu_s, 1),
            ("memory_mb", memory_mb, 32),
            ("max_output_bytes", max_output_bytes, 64),
            ("max_output_chars", max_output_chars, 20),
            ("max_concurrent", max_concurrent, 1),
            ("max_processes", max_processes, 2),
        ]
        for name, value, low in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(cpus, (int, float)) or isinstance(cpus, bool) or not cpus >= 0.01:
            raise ValueError(f"cpus must be a number >= 0.01, got {cpus!r}")
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox must be one of {list(SANDBOX_MODES)}, got {sandbox!r}")
        try:  # probed once per process: refuse here, before a run starts, not mid-episode
            self.mechanism = mechanism_for(sandbox)
        except SandboxUnavailable as exc:
            raise ValueError(str(exc)) from None
        check_cgroup(cgroup)
        missing = missing_limits(self.mechanism, cgroup)
        if missing and missing not in _WARNED_MISSING:  # the preflight shows it, once
            _WARNED_MISSING.add(missing)
            log.warning("pytool: the sandbox runs here with %s", missing)
        self.max_processes, self.cpus, self.cgroup = max_processes, float(cpus), cgroup
        self.sandbox = sandbox
        self.templates = chosen
        self.max_runs, self.timeout_s = max_runs, float(timeout_s)
        self.cpu_s, self.memory_mb = cpu_s, memory_mb
        self.max_output_bytes, self.max_output_chars = max_output_bytes, max_output_chars
        self.max_concurrent, self.format_penalty = max_concurrent, format_penalty
        self.task: Task | None = None
        self._outputs: list[str] = []
        self._done = False

    def _anchor(self) -> str:
        assert self.task is not None
        if self._done:
            return f"{self.task.key}|answered"
        digest = hashlib.sha1("\x00".join(self._outputs).encode()).hexdigest()[:10] if self._outputs else "-"
        return f"{self.task.key}|r{len(self._outputs)}|{digest}"

    def _invalid(self, text: str, reason: str) -> StepResult:
        return StepResult(
            Observation(text, anchor=self._anchor()),
            self.format_penalty,
            False,
            {"valid": False, "success": False, "reason": reason},
        )

    async def reset(self, seed: int) -> Observation:
        self.task = make_task(seed, self.templates)
        self._outputs, self._done = [], False
        return Observation(f"Question: {self.task.question}", anchor=self._anchor())

    async def step(self, action: str) -> StepResult:
        if self.task is None or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        match = _ACTION.search(action)
        if match is None:
            return self._invalid(_INVALID, "no_tag")
        tag, content = match.groups()
        if tag == "answer":
            correct = parse_integer(content) == self.task.answer
            self._done = True
            return StepResult(
                Observation("", anchor=self._anchor()),
                1.0 if correct else 0.0,
                True,
                {"valid": True, "success": correct, "runs": len(self._outputs)},
            )
        fenced = _FENCE.match(content)
        code = fenced.group(1) if fenced else content
        if not code.strip():
            return self._invalid(_INVALID, "empty_code")
        if len(self._outputs) >= self.max_runs:
            return self._invalid(
                f"You have used all {self.max_runs} runs. Now give the final answer "
                "inside <answer> and </answer>.",
                "run_limit",
            )
        result = await run_python(
            code,
            timeout_s=self.timeout_s,
            cpu_s=self.cpu_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
            max_concurrent=self.max_concurrent,
            sandbox=self.sandbox,
            max_processes=self.max_processes,
            cpus=self.cpus,
            cgroup=self.cgroup,
        )
        self._outputs.append(self._show(result))
        return StepResult(
            Observation(f"<output>{self._outputs[-1]}</output>", anchor=self._anchor()),
            0.0,
            False,
            {"valid": True, "success": False, "runs": len(self._outputs), "tool_status": result.status},
        )

    def _show(self, result: RunResult) -> str:
        text = result.output.rstrip()
        notes = {
            "timeout": f"TimeoutError: stopped after {self.timeout_s:g} s",
            "cpu_limit": f"stopped: over the CPU limit of {self.cpu_s} s",
            "truncated": f"[stopped: more than {self.max_output_bytes} bytes of output]",
            "killed": f"killed by signal {-(result.returncode or 0)}",
            "memory_limit": f"killed: its processes together went over {self.memory_mb} MB",
        }
        if result.status in notes:
            text = f"{text}\n{notes[result.status]}" if text else notes[result.status]
        return _shorten(text, self.max_output_chars) if text else "(no output; print what you need)"

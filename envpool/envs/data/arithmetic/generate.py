"""Generate the shipped arithmetic set: `python envpool/envs/data/arithmetic/generate.py`.

Writes train.jsonl and eval.jsonl beside this file, deterministically (a fixed seed, so running
it again gives the same bytes). Each row is {"prompt", "answer", "a", "op", "b"}: a sum or
difference of two digits whose result is in 0..MAX_ANSWER ("What is 7 - 5?" -> "2").

Why so small a task: it is the worked example that the tiny random-weight model must show
learning on in tens of CPU steps. Every answer is one token of the tiny tokenizer (its
pre-tokenizer splits digits), a random policy already emits digits now and then (its corpus
holds numbers), so rewards differ within groups from the first step, and the matcher
(envpool/scoring/rewards.py, last number in the reply) needs no format the model must discover first.
Answers stay in 0..3, so they are few and unevenly frequent (0 is the most common): a random
model cannot compute them, but it learns in tens of steps to end its reply with a digit and to
favour the frequent answers, which lifts the reward from a few percent to about a third; what
it learns beyond that is arithmetic. The eval split holds problems the train split does not
(disjoint by (a, op, b)).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 12
MAX_ANSWER = 3
HELD_OUT = 12
TRAIN_ROWS = 512


def problems() -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer) with digits a, b and the answer in 0..MAX_ANSWER (44 of them)."""
    out = []
    for a in range(10):
        for b in range(10):
            if a + b <= MAX_ANSWER:
                out.append((a, "+", b, a + b))
            if 0 <= a - b <= MAX_ANSWER:
                out.append((a, "-", b, a - b))
    return out


def row(a: int, op: str, b: int, answer: int) -> dict:
    return {"prompt": f"What is {a} {op} {b}?", "answer": str(answer), "a": a, "op": op, "b": b}


def main() -> None:
    rng = random.Random(SEED)
    every = problems()
    rng.shuffle(every)
    held_out, seen = every[:HELD_OUT], every[HELD_OUT:]
    train = [rng.choice(seen) for _ in range(TRAIN_ROWS)]
    for name, rows in (("train", train), ("eval", held_out)):
        lines = [json.dumps(row(*p), sort_keys=True) for p in rows]
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()

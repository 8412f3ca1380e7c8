"""Generate the shipped arithmetic set: `python envpool/envs/data/arithmetic/generate.py`.

Writes train.jsonl and eval.jsonl beside this file, deterministically (a fixed seed, so running
it again gives the same bytes). Each row is {"prompt", "answer", "a", "op", "b"}: a sum or
difference of two digits 0..MAX whose result is in 0..MAX too ("What is 5 - 3?" -> "2").

Why so small a task: it is the worked example that the tiny random-weight model must show
learning on in tens of CPU steps. Every answer is one token of the tiny tokenizer (its
pre-tokenizer splits digits), a random policy already emits digits now and then (its corpus
holds numbers), so rewards differ within groups from the first step, and the matcher
(envpool/rewards.py, last number in the reply) needs no format the model must discover first.
The eval split holds problems the train split does not (disjoint by (a, op, b)).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 12
MAX = 5
HELD_OUT = 12
TRAIN_ROWS = 512


def problems() -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer) with a, b and the answer in 0..MAX."""
    out = []
    for a in range(MAX + 1):
        for b in range(MAX + 1):
            if a + b <= MAX:
                out.append((a, "+", b, a + b))
            if a - b >= 0:
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

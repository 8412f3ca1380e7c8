"""Generate the shipped arithmetic set: `python envpool/envs/data/arithmetic/generate.py`.

Writes train.jsonl and eval.jsonl beside this file, deterministically (a fixed seed, so running
it again gives the same bytes). Each row is {"prompt", "answer", "a", "op", "b"}: a sum or
difference of two single digits whose result is a single digit 0..9 ("What is 7 - 3?" -> "4").

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
TRAIN_ROWS = 512


def problems() -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer) with single digits a, b and a single-digit answer."""
    out = []
    for a in range(10):
        for b in range(10):
            if a + b <= 9:
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
    held_out, seen = every[:40], every[40:]
    train = [rng.choice(seen) for _ in range(TRAIN_ROWS)]
    for name, rows in (("train", train), ("eval", held_out)):
        lines = [json.dumps(row(*p), sort_keys=True) for p in rows]
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()

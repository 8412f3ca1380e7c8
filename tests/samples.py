"""Random training samples for learner tests (not a test module)."""

import random

from millstream.learner.train.trainer import TrainSample


def random_samples(n: int, seed: int, max_len: int = 24) -> list[TrainSample]:
    """`n` sequences of 8..max_len tokens: a prompt, then generated tokens with one advantage."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(8, max_len)
        prompt = rng.randint(2, length - 3)
        mask = [0] * prompt + [1] * (length - prompt)
        adv = rng.uniform(-1.0, 1.0)
        out.append(
            TrainSample(
                [rng.randrange(3, 512) for _ in range(length)],
                mask,
                [-rng.uniform(4.0, 8.0) * m for m in mask],
                [adv * m for m in mask],
            )
        )
    return out

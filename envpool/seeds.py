"""Where every random choice of an episode comes from: the run's seed, nothing else.

A group's seed picks its task (every member of a group gets the same one); a turn's sampling seed
derives from the group seed, the member and the turn, so a run is reproducible and the members of
a group still sample differently. A retried request carries the same seed.
"""

__all__ = ["group_seed", "sampling_seed", "request_seed"]


def group_seed(run_seed: int, group_number: int) -> int:
    """The seed of group `group_number` of a run seeded with `run_seed`."""
    return (run_seed * 7_919_981 + group_number * 104_729 + 17) % (2**31 - 1)


def sampling_seed(seed: int, member: int, turn: int) -> int:
    """The sampling seed of one turn of one member of the group seeded with `seed`."""
    return (seed * 1_000_003 + member * 10_007 + turn) % (2**31 - 1)


def request_seed(seed: int, member: int, asked: int, index: int) -> int:
    """The sampling seed of an agent's call that names its own `seed` (`asked`), for its
    `index`-th sample: the same request repeats its reply within an episode, as with vLLM, while
    the members of a group (`member`) still sample differently, as GRPO needs."""
    return (seed * 1_000_003 + member * 10_007 + 7_777_777 + asked * 131 + index) % (2**31 - 1)

"""Flows whose episodes use several contexts or untrained turns, trained end to end.

`markovian` (Delethink) starts a fresh context per chunk, so its trajectories carry
`segment_starts` and the learner trains each context as its own sequence; `agentflow` starts a
fresh context per module call and masks executor and verifier turns. A short real run of each
checks that such trajectories reach the learner, train, and are all accounted for.
"""

import pytest
from helpers import check_accounting, millstream_run, read_episodes, steps_of


@pytest.mark.parametrize("env", ["markovian", "agentflow"])
def test_multi_context_flows_train_end_to_end(actor, tmp_path, env):
    run_dir = tmp_path / "run"
    millstream_run(actor, run_dir, "train.steps=2", f"envpool.env={env}", "envpool.max_tokens=16")
    check_accounting(run_dir)
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["train/tokens"] > 0 for s in steps)
    trained = [r for r in read_episodes(run_dir) if r["fate"] == "trained"]
    assert trained
    # A random tiny model rarely finishes a chunk with an answer or writes a valid plan, so most
    # episodes run several turns: each later turn opened a fresh context.
    with_segments = [r for r in trained if r["segment_starts"]]
    assert len(with_segments) > len(trained) // 2
    # The learner trained one sequence per context that holds a trained token, not one per episode.
    contexts = sum(1 for r in trained for a, b in _spans(r) if any(r["loss_mask"][a:b]))
    assert sum(s["train/sequences"] for s in steps) == contexts
    for r in with_segments:
        bounds = [0, *r["segment_starts"], len(r["token_ids"])]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
        for a in r["segment_starts"]:
            assert r["loss_mask"][a] == 0  # every context opens with its prompt
        # Every generated turn lies inside one context.
        for s, e in zip(r["turn_starts"], r["turn_ends"]):
            assert any(a <= s and e <= b for a, b in zip(bounds, bounds[1:]))


def _spans(r):
    bounds = [0, *r["segment_starts"], len(r["token_ids"])]
    return list(zip(bounds, bounds[1:]))

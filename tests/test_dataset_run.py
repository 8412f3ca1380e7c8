"""End to end: `millstream run` on the shipped arithmetic set with evaluation every 5 steps.

The real actor (vLLM, the session's), the real DeepSpeed learner and an envpool worker; what is
asserted comes from the run's own outputs. The tiny random model cannot do arithmetic; what it
learns in 20 steps is the answer's form and the answers' frequencies (its replies come to end
with a digit, and the most common ones), which takes the train reward from near 0 well up.
Evaluation rounds (greedy, on the held-out split) appear as `eval/...` records at every fifth
version, the final one lands in summary.json, and no evaluation episode is trained or counted
among the run's episodes.
"""

import statistics

import orjson
from helpers import check_accounting, millstream_run, read_episodes, steps_of

from millstream.shared.obs.metrics import read_jsonl


def test_dataset_run_learns_and_evaluates(actor, tmp_path):
    run_dir = tmp_path / "run"
    proc = millstream_run(
        actor,
        run_dir,
        "envpool.env=dataset",
        "envpool.env_args.path=millstream:arithmetic",
        "envpool.max_tokens=8",
        "train.steps=20",
        # 12 problems a step, not 4: the policy soon settles on one answer, so a step's reward is
        # about the share of its problems with that answer (0.2 to 0.3); more problems, less noise.
        "train.group_size=4",
        "train.groups_per_batch=12",
        "eval.every=5",
        'eval.env_args={split="eval"}',
        "eval.episodes=12",
    )
    assert "accounting ok" in proc.stdout
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 21))
    first = statistics.fmean(r["reward/mean"] for r in steps[:5])
    last = statistics.fmean(r["reward/mean"] for r in steps[-5:])
    # Measured on a loaded 2-core machine: 0.00 -> 0.16 with 8 problems a step, 0.00 -> 0.17 with
    # 12; a policy that learns nothing stays near 0.02.
    assert last - first >= 0.08, f"reward {first:.3f} -> {last:.3f}"

    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/version" in r]
    assert [r["eval/version"] for r in evals] == [0, 5, 10, 15, 20]
    for record in evals:
        assert record["step"] == record["eval/version"] and record["eval/problems"] == 12
        assert record["eval/episodes"] == 12 and not record["eval/timed_out"]
        assert 0.0 <= record["eval/reward_mean"] <= 1.0 and "eval/pass@1" in record
        assert record["eval/token_version_min"] >= record["eval/version"]

    summary = check_accounting(run_dir)
    assert summary["eval_final"] is True and summary["eval"]["version"] == 20
    assert summary["eval_rounds"] == 5 and summary["eval_episodes"] == 60
    # Evaluation episodes are not the run's: every trained one is a training group's member.
    trained = [r for r in read_episodes(run_dir) if r["fate"] == "trained"]
    assert trained and all(r["group_id"].startswith("g") for r in trained)
    assert orjson.loads((run_dir / "summary.json").read_bytes())["eval"]["problems"] == 12

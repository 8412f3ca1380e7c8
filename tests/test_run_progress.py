"""What `millstream run` says while its roles start (shared/launch/progress.py), on a fake clock."""

import io

from millstream.shared.launch.progress import NOTICE_EVERY_S, StartupProgress
from millstream.shared.process.runtime import ready_file


def test_each_role_is_announced_once_ready_and_the_slow_ones_are_named_with_their_log(tmp_path):
    (tmp_path / "logs").mkdir()
    out = io.StringIO()
    progress = StartupProgress(tmp_path, ["actor", "learner", "envpool-0"], out, now=100.0)
    progress.poll(101.0)
    assert out.getvalue() == ""
    ready_file(tmp_path, "envpool-0").write_text("{}")
    progress.poll(103.0)
    assert out.getvalue() == "millstream run: envpool-0 ready in 3s (connected, waiting for the learner)\n"
    progress.poll(103.0 + NOTICE_EVERY_S)  # nothing new for NOTICE_EVERY_S: say who is slow
    last = out.getvalue().splitlines()[-1]
    assert last == f"millstream run: still starting: actor, learner (33s; log: {tmp_path}/logs/actor.log)"
    ready_file(tmp_path, "actor").write_text("{}")
    ready_file(tmp_path, "learner").write_text("{}")
    progress.poll(150.0)
    assert out.getvalue().splitlines()[-3:] == [
        "millstream run: actor ready in 50s (engine loaded, serving)",
        "millstream run: learner ready in 50s (first weights pushed to the actor)",
        "millstream run: every role is ready; training lines follow as batches fill",
    ]
    # A restarted actor is announced again, alone; a follower rank is never awaited.
    ready_file(tmp_path, "actor").unlink()
    progress.started("actor", 200.0)
    progress.started("learner-rank1", 200.0)
    progress.poll(201.0)
    ready_file(tmp_path, "actor").write_text("{}")
    progress.poll(240.0)
    assert out.getvalue().splitlines()[-1] == "millstream run: actor ready in 40s (engine loaded, serving)"
    assert "every role is ready" not in out.getvalue().splitlines()[-1]
    assert progress.waiting == {}


def test_the_closing_line_counts_the_episodes_the_end_caught_once(tmp_path):
    import orjson

    from millstream.shared.launch.launcher import _print_summary

    summary = {
        "episodes_started": 512,
        "episodes_trained": 480,
        "episodes_dropped": {"run_ended": 16},
        "episodes_failed": {"run_ended": 14, "env_error": 2},
        "accounting_ok": True,
        "final_weights": "w",
    }
    (tmp_path / "summary.json").write_bytes(orjson.dumps(summary))
    out = io.StringIO()
    _print_summary(tmp_path, out)
    first = out.getvalue().splitlines()[0]
    assert first == (
        "episodes: started 512, trained 480, left at the end 30 (16 finished in incomplete groups, "
        "14 running), dropped {}, failed {'env_error': 2} (accounting ok)"
    )

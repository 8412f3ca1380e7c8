"""The run directory's resume logic without a run: rolled-back marks by offset, the abandoned
timeline's checkpoints, and which differences a resume refuses."""

import msgspec
import orjson
import pytest

from millstream.shared.config import load_config
from millstream.shared.obs.metrics import MetricsWriter, read_jsonl
from millstream.shared.store.rundir import (
    STATE_FILE,
    checkpoint_records,
    find_checkpoint,
    mark_rolled_back,
    resume_conflicts,
    retire_later_checkpoints,
)


def write_records(path, records, torn: bytes = b""):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records) + torn)


def test_records_after_the_checkpoint_offsets_are_marked_and_nothing_else(tmp_path):
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        metrics.write({"step": step})
    at_checkpoint = metrics.position()  # what the learner stores in the checkpoint
    metrics.write({"event": "checkpoint", "step": 3})  # written just after it saved
    for step in (4, 5):
        metrics.write({"step": step})
    metrics.write({"event": "checkpoint", "step": 5})
    metrics.close()
    # A failure that arrived before the checkpoint keeps its place whatever its version.
    write_records(
        tmp_path / "trajectories.jsonl",
        [{"fate": "failed", "version": 3}, {"fate": "trained", "step": 4}],
        torn=b'{"fate": "trai',
    )
    first = (tmp_path / "trajectories.jsonl").read_bytes().index(b"\n") + 1

    marked = mark_rolled_back(tmp_path, {"metrics.jsonl": at_checkpoint, "trajectories.jsonl": first}, step=3)
    assert marked == {"metrics.jsonl": 3, "trajectories.jsonl": 1}
    steps = [
        (r.get("event", ""), r["step"], r.get("rolled_back", False))
        for r in read_jsonl(tmp_path / "metrics.jsonl")
    ]
    assert steps == [
        ("", 1, False),
        ("", 2, False),
        ("", 3, False),
        ("checkpoint", 3, False),  # the checkpoint resumed from stands
        ("", 4, True),
        ("", 5, True),
        ("checkpoint", 5, True),
    ]
    lines = (tmp_path / "trajectories.jsonl").read_bytes().splitlines()
    assert len(lines) == 2  # the torn line left by the kill is gone
    assert orjson.loads(lines[0]) == {"fate": "failed", "version": 3}
    # Marking again (a second resume from the same checkpoint) changes nothing.
    assert mark_rolled_back(tmp_path, {"metrics.jsonl": at_checkpoint}, step=3) == {"metrics.jsonl": 0}


def make_checkpoint(root, step, records):
    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True)
    state = {"format": 1, "version": step, "extra": {"records": records}}
    (folder / STATE_FILE).write_bytes(msgspec.msgpack.encode(state))
    return folder


def test_a_resume_retires_the_later_checkpoints_of_the_abandoned_timeline(tmp_path):
    root = tmp_path / "checkpoints"
    four = make_checkpoint(root, 4, {"metrics.jsonl": 40})
    make_checkpoint(root, 6, {"metrics.jsonl": 60})
    (root / "latest").write_text("step_000006\n")
    assert checkpoint_records(four) == {"metrics.jsonl": 40}
    moved = retire_later_checkpoints(tmp_path, 4)
    assert [p.name for p in moved] == ["rolled-back-step_000006"]
    assert find_checkpoint(tmp_path) == four  # `latest` no longer names the abandoned step 6


def test_a_resume_refuses_what_defines_the_experiment_and_allows_the_rest():
    before = load_config(None, ["train.steps=10"])
    after = load_config(
        None,
        [
            "train.steps=20",
            "learner.lr=0.1",
            "envpool.env=echo",
            "learner.micro_batch_size=4",
            "actor.address=tcp://127.0.0.1:5",
            "judge.address=tcp://127.0.0.1:6",  # addresses are picked afresh at each start
        ],
    )
    refused, changed = resume_conflicts(before, after)
    assert refused == ["envpool.env: 'evenchars' -> 'echo'", "learner.lr: 0.004 -> 0.1"]
    assert changed == ["learner.micro_batch_size: 16 -> 4", "train.steps: 10 -> 20"]


def test_a_resume_keeps_the_lora_adapters_it_trained():
    """The adapters' rank and targets are the checkpoint's shapes (another fails inside the
    learner's load, after every role started), and alpha / rank their scale (another changes
    the policy at the resume without a word); all four are refused before anything starts."""
    before = load_config(None, ["learner.lora_rank=4"])
    for override in (
        "learner.lora_rank=8",
        "learner.lora_alpha=64.0",
        "learner.lora_dropout=0.1",
        "learner.lora_target_modules=['q_proj']",
    ):
        refused, _ = resume_conflicts(before, load_config(None, ["learner.lora_rank=4", override]))
        assert [r.split(":")[0] for r in refused] == [override.split("=")[0]], refused


def test_a_checkpoint_moved_aside_is_refused_with_the_reason(tmp_path):
    from millstream.shared.config import ConfigError
    from millstream.shared.store.rundir import STATE_FILE, plan_resume

    aside = tmp_path / "run" / "checkpoints" / "rolled-back-step_000008"
    aside.mkdir(parents=True)
    (aside / STATE_FILE).write_bytes(b"")
    (tmp_path / "run" / "config.toml").write_text("")
    with pytest.raises(
        ConfigError, match="rolled-back-step_000008 is not named as a run names its checkpoints"
    ):
        plan_resume(str(aside))


def test_without_adapters_their_settings_may_change_on_resume():
    """lora_alpha, lora_dropout and lora_target_modules mean nothing at lora_rank = 0."""
    refused, changed = resume_conflicts(load_config(None, []), load_config(None, ["learner.lora_alpha=64.0"]))
    assert refused == [] and changed == ["learner.lora_alpha: 16.0 -> 64.0"]

"""Dashboards: the metrics backends (TensorBoard, offline W&B), the learner's domain metrics, and
`millstream plot`; then one real short run with every backend, plotted.

The backend units write through `open_metrics` and read the results back with the backends' own
readers (TensorBoard's EventAccumulator) or from the offline run's files (W&B has no offline
reader: its run file must hold the keys). The real run uses the session's actor (conftest).
"""

import os
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from helpers import MILLSTREAM, ROOT, check_accounting, millstream_run, steps_of

from millstream.learner.replay import Group
from millstream.learner.stats import batch_metrics, domain_metrics
from millstream.shared.config import ConfigError, load_config
from millstream.shared.inspect.plot import plot_run
from millstream.shared.obs.dashboards import backend_problem, open_metrics, step_scalars
from millstream.shared.wire import Trajectory, Truncation

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def scalars_in_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_step_records(tmp_path):
    metrics = open_metrics(tmp_path, ["jsonl", "tensorboard"])
    for step in (1, 2, 3):
        metrics.write({"step": step, "reward/mean": step / 4, "train/entropy": 2.0 - step, "env": "x"})
    metrics.write({"event": "checkpoint", "step": 3, "path": "ckpt"})  # events are not curves
    metrics.close()
    scalars = scalars_in_tensorboard(tmp_path / "tensorboard")
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [v for _, v in scalars["train/entropy"]] == [1.0, 0.0, -1.0]
    assert set(scalars) == {"reward/mean", "train/entropy"}  # strings, time and events left out
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 4  # the JSONL keeps everything


@pytest.mark.slow
def test_wandb_writes_an_offline_run_with_the_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network attempt would fail
    metrics = open_metrics(tmp_path, ["jsonl", "wandb"], wandb_project="p", wandb_tags=["t1"])
    assert "wandb" in metrics.backends
    for step in (1, 2):
        metrics.write({"step": step, "reward/mean": 0.125 * step, "episode/success_rate": 0.5})
    # An evaluation round arrives after training went on: its step (the version) is behind.
    metrics.write({"step": 1, "eval/version": 1, "eval/reward_mean": 0.375})
    metrics.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    history = next(runs[0].glob("run-*.wandb")).read_bytes()
    for needle in (b"reward/mean", b"episode/success_rate", b"0.25", b"t1", b"eval/reward_mean", b"0.375"):
        assert needle in history, needle


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_metrics_wandb_mode_is_the_mode_wandb_starts_in(tmp_path, monkeypatch, mode):
    """`metrics.wandb_mode` reaches wandb.init and WANDB_MODE (the recorder stands in for W&B's
    servers: an online run must not reach the network from a test)."""
    import wandb

    seen: dict = {}

    class RecordedRun:
        def define_metric(self, *args, **kwargs):
            pass

    def recording_init(**kwargs):
        seen.update(kwargs, env_mode=os.environ["WANDB_MODE"])
        return RecordedRun()

    monkeypatch.setattr(wandb, "init", recording_init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(overrides=[f"metrics.wandb_mode={mode}"])
    metrics = open_metrics(tmp_path, ["jsonl", "wandb"], wandb_mode=cfg.metrics.wandb_mode)
    assert "wandb" in metrics.backends and seen["mode"] == seen["env_mode"] == mode
    with pytest.raises(ConfigError, match="metrics.wandb_mode"):
        load_config(overrides=["metrics.wandb_mode=live"])


def test_a_failing_backend_is_switched_off_and_the_jsonl_goes_on(tmp_path, caplog):
    class Broken:
        calls = 0

        def log(self, scalars, step):
            Broken.calls += 1
            raise OSError("disk full")

        def close(self):
            pass

    metrics = open_metrics(tmp_path, ["jsonl"])
    metrics.backends["broken"] = Broken()
    for step in (1, 2, 3):
        metrics.write({"step": step, "reward/mean": 1.0})
    metrics.close()
    assert Broken.calls == 1 and "broken" not in metrics.backends
    assert sum("switched off" in r.message for r in caplog.records) == 1
    assert (tmp_path / "metrics.jsonl").read_text().count("reward/mean") == 3


def test_step_scalars_keeps_numbers_and_drops_events():
    assert step_scalars({"event": "resume", "step": 2}) is None
    assert step_scalars({"summary": {}}) is None
    got = step_scalars({"step": 2, "time": 1.0, "a/b": 1, "ok": True, "s": "x", "n": float("nan")})
    assert got == {"a/b": 1.0, "ok": 1.0}


def test_backends_are_checked_with_the_config():
    assert load_config(overrides=["metrics.backends=['jsonl','tensorboard','wandb']"]).metrics.backends
    with pytest.raises(ConfigError, match="metrics.backends"):
        load_config(overrides=["metrics.backends=['jsonl','mlflow']"])
    with pytest.raises(ConfigError, match="'jsonl' is required"):
        load_config(overrides=["metrics.backends=['tensorboard']"])
    assert "not installed" in _missing_package()


def _missing_package() -> str:
    from millstream.shared.obs import dashboards

    saved = dict(dashboards.BACKENDS)
    dashboards.BACKENDS["wandb"] = "no_such_package_for_millstream"
    try:
        return backend_problem(["jsonl", "wandb"]) or ""
    finally:
        dashboards.BACKENDS.clear()
        dashboards.BACKENDS.update(saved)


def episode(
    env: str = "a",
    *,
    turns: int = 1,
    gen: int = 3,
    invalid: int = 0,
    success: bool | None = None,
    truncated: Truncation | None = None,
    reward: float = 1.0,
) -> Trajectory:
    """`turns` turns of 2 prompt tokens then `gen` generated tokens each."""
    ids, mask, starts, ends = [], [], [], []
    for _ in range(turns):
        ids += [0, 0]
        starts.append(len(ids))
        ids += [1] * gen
        ends.append(len(ids))
        mask += [0, 0] + [1] * gen
    return Trajectory(
        episode_id="e",
        group_id="g",
        seed=0,
        env=env,
        token_ids=ids,
        loss_mask=mask,
        logprobs=[0.0] * len(ids),
        versions=[0 if m else -1 for m in mask],
        reward=reward,
        turn_rewards=[reward / turns] * turns,
        num_turns=turns,
        group_size=2,
        duration_s=0.1,
        turn_starts=starts,
        turn_ends=ends,
        invalid_actions=invalid,
        success=success,
        truncated=truncated,
    )


def test_domain_metrics_of_hand_made_episodes():
    eps = [
        episode(turns=1, gen=2, success=True),
        episode(turns=2, gen=5, invalid=1, success=False, truncated=Truncation.MAX_TURNS),
        episode(turns=1, gen=10, success=None),  # the env never said: not in the success rate
        episode(turns=4, gen=1, invalid=2),
    ]
    m = domain_metrics(eps)
    assert m["episode/success_rate"] == 0.5
    assert m["episode/invalid_action_rate"] == 3 / 8  # invalid turns over all turns
    assert m["episode/truncated_rate"] == 0.25
    assert m["episode/turns_mean"] == 2.0
    assert m["episode/response_len/mean"] == (2 + 10 + 10 + 4) / 4
    assert m["episode/response_len/max"] == 10.0 and m["episode/response_len/p95"] == 10.0
    assert m["episode/segments_mean"] == 1.0  # none of them has a second context
    assert m["episode/sequence_tokens_mean"] == (4 + 14 + 12 + 12) / 4
    assert not any(k.startswith("env/") for k in m)  # one env: no per-env copies


def test_domain_metrics_split_by_env_when_envs_mix():
    m = domain_metrics(
        [episode("a", success=True), episode("a", success=True), episode("b", success=False, reward=0.0)]
    )
    assert m["episode/success_rate"] == pytest.approx(2 / 3)
    assert m["env/a/success_rate"] == 1.0 and m["env/b/success_rate"] == 0.0
    assert m["env/a/episodes"] == 2 and m["env/b/reward_mean"] == 0.0
    assert "success_rate" not in "".join(domain_metrics([episode()]))  # no env said: no rate


def test_batch_metrics_carry_the_domain_metrics():
    group = Group("g", [episode(success=True), episode(success=False)], 0, 0)
    m = batch_metrics([group], version=1, step_s=1.0, elapsed_s=2.0)
    assert m["episode/success_rate"] == 0.5 and m["reward/mean"] == 1.0


def write_metrics(path: Path) -> None:
    metrics = open_metrics(path, ["jsonl"])
    for step in range(1, 6):
        metrics.write(
            {
                "step": step,
                "reward/mean": step / 10,
                "train/entropy": 3.0 - step / 5,
                "train/grad_norm": 1.0 / step,
                "staleness/mean": 0.5,
                "episode/response_len/mean": 20.0 + step,
            }
        )
    metrics.write({"event": "checkpoint", "step": 5})
    metrics.close()


def test_plot_writes_pngs_and_says_what_it_skipped(tmp_path):
    write_metrics(tmp_path)
    written, skipped = plot_run(tmp_path, tmp_path / "png")
    assert {p.stem for p in written} == {"reward", "entropy", "grad_norm", "staleness", "lengths"}
    assert set(skipped) == {"eval", "throughput", "episodes"}
    for png in written:
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (700, 400)
        assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]  # IHDR intact


def test_plot_command_errors_on_a_folder_without_metrics(tmp_path):
    proc = subprocess.run([*MILLSTREAM, "plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_real_run_with_every_backend_then_plot(actor, tmp_path):
    run_dir = tmp_path / "run"
    millstream_run(
        actor,
        run_dir,
        "train.steps=2",
        "metrics.backends=['jsonl','tensorboard','wandb']",
        "metrics.wandb_tags=['ci']",
    )
    check_accounting(run_dir)
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    # evenchars reports success: every step carries the domain metrics
    for key in (
        "episode/success_rate",
        "episode/response_len/p95",
        "episode/turns_mean",
        "episode/truncated_rate",
    ):
        assert all(key in r for r in steps), key
    tb = scalars_in_tensorboard(run_dir / "tensorboard")
    assert [s for s, _ in tb["reward/mean"]] == [1, 2]
    assert [v for _, v in tb["reward/mean"]] == pytest.approx([r["reward/mean"] for r in steps])
    assert "train/entropy" in tb and "episode/success_rate" in tb
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    assert b"episode/response_len/mean" in next(offline.glob("run-*.wandb")).read_bytes()
    assert "Traceback" not in (run_dir / "logs" / "learner.log").read_text()  # wandb shut down cleanly
    proc = subprocess.run([*MILLSTREAM, "plot", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pngs = {p.stem for p in (run_dir / "plots").glob("*.png")}
    assert {"reward", "entropy", "grad_norm", "staleness", "throughput", "lengths", "episodes"} <= pngs
    assert "skipped eval" in proc.stdout  # no eval configured in this run

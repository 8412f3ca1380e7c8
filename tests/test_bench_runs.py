"""The benchmarks of issue 13 run end to end at minimal sizes and write what they promise; their
numbers are not checked (benchmarks measure, tests assert behaviour)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import orjson
import pytest
from helpers import ROOT

from millstream.bench import all as runner
from millstream.bench import async_sync, engine_push, weight_sync
from millstream.shared.config import check_config, load_config


@pytest.mark.real
def test_weight_sync_pushes_through_millstream_and_raw_gloo(tmp_path):
    path = weight_sync.main(["--sizes", "1", "--rounds", "1", "--out", str(tmp_path)])
    (row,) = orjson.loads(path.read_bytes())["rows"]
    assert row["mb"] == 1 and row["gloo_s"] > 0 and row["ours_s"] > 0 and row["paused_s"] > 0
    per_size = orjson.loads((tmp_path / "weight-sync-1MB.json").read_bytes())
    assert per_size["settings"]["bytes"] == 16 * (2**20 // 64) * 4  # 1 MB of float32 in 16 tensors
    assert set(per_size["samples"]) == {"gloo", "millstream"}
    assert (tmp_path / "weight-sync-1MB.png").stat().st_size > 0


def vllm_processes() -> set[int]:
    """Pids of vLLM's engine processes on this machine (they name themselves VLLM::...)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"VLLM::"):
                found.add(int(entry.name))
        except OSError:  # ended meanwhile
            continue
    return found


@pytest.mark.real
def test_engine_push_pushes_a_models_weights_to_a_generating_vllm_actor(tiny_model_dir, tmp_path):
    argv = ["--model", str(tiny_model_dir), "--pushes", "2", "--streams", "2", "--gap-s", "0.5"]
    engines_before = vllm_processes()
    path = engine_push.main([*argv, "--out", str(tmp_path)])
    deadline = time.monotonic() + 10  # a SIGKILL is delivered, not waited for
    while not vllm_processes() <= engines_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert vllm_processes() <= engines_before  # the actor's engine processes ended with it
    result = orjson.loads(path.read_bytes())
    assert len(result["pushes"]) == 2 and result["bytes"] > 0
    for push in result["pushes"]:
        assert (
            push["sync/total_s"] > 0 and push["sync/actor_receive_s"] > 0 and push["sync/actor_paused_s"] > 0
        )
    assert result["summary"]["tokens_per_s_before"]["max"] > 0  # the streams were served


def test_engine_push_names_a_missing_model_before_it_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        engine_push.parse(["--model", str(tmp_path)])
    assert "no config.json there" in capsys.readouterr().err


@pytest.mark.parametrize("stack", sorted(async_sync.STACKS))
@pytest.mark.parametrize("size", ["quick", "full"])
def test_async_sync_settings_are_valid_config(stack, size):
    """Every run the benchmark starts would pass `millstream run`'s config check."""
    for k in (0, 4):
        overrides = [*async_sync.COMMON, *async_sync.STACKS[stack][size], f"train.max_staleness={k}"]
        check_config(load_config(None, overrides))


def test_runner_skips_missing_modules_and_runs_the_rest(monkeypatch, capsys):
    # `kit.rounds` stands in for a benchmark: `python -m millstream.bench.kit.rounds` exits 0 at once.
    monkeypatch.setattr(runner, "MODULES", ["no_such_benchmark", "kit.rounds"])
    assert runner.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "no_such_benchmark: skipped" in out
    assert "| kit.rounds | ok |" in out and "| no_such_benchmark | skipped |" in out
    with pytest.raises(SystemExit):
        runner.main(["--only", "nope"])


@pytest.mark.parametrize("shape", ["waves", "closed"])
def test_load_counts_every_token_of_concurrent_requests(shape):
    """Requests that finish while others are in flight each add their tokens (a `tokens += await`
    once kept only the last finisher's count per wave)."""
    import anyio

    from millstream.bench.baselines.overhead_load import run_load

    async def one(index: int) -> tuple[int, float | None]:
        delay = 0.001 * (index % 5)
        await anyio.sleep(delay)
        return 7, delay

    result = anyio.run(run_load, one, shape, 16, 3, 0.05)
    assert result["requests"] >= 16 * (3 if shape == "waves" else 1)
    assert result["tokens"] == 7 * result["requests"]
    # First-token times as the systems report them: delays of 0-4 ms, a median among them.
    assert 0 <= result["first_token_ms_p50"] <= result["first_token_ms_p90"] <= 4 + 1e-9  # ms from s


def test_one_awake_stops_every_engine_but_the_measured_one():
    """The overhead benchmark measures one engine at a time: the others' process groups are
    stopped (an idle vLLM engine spins), and all are woken again at the end."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from millstream.bench.overhead import OneAwake

    def stopped(pid: int) -> bool:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

    def settles_to(want: list[bool]) -> list[bool]:
        """Which are stopped, polled until it is `want` (signals land asynchronously) or 10 s."""
        deadline = time.monotonic() + 10
        while (seen := [stopped(p.pid) for p in procs.values()]) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        return seen

    procs = {
        name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        for name in ("a", "b", "c")
    }
    try:
        awake = OneAwake({name: p.pid for name, p in procs.items()}, settle_s=0.05)
        awake.only("b")
        assert settles_to([True, False, True]) == [True, False, True]
        awake.only("a")
        assert settles_to([False, True, True]) == [False, True, True]
        awake.wake_all()
        assert settles_to([False, False, False]) == [False, False, False]  # awake: running or asleep
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_spawn_leads_a_group_in_this_session_and_reads_nothing():
    """A benchmark's engine leads a group of its own (killpg takes its children) in the
    benchmark's session: in a session of its own, autogroup starved the measuring client."""
    import os
    import subprocess
    import sys

    from millstream.bench.kit.spawn import spawn

    report = "import os, sys; print(os.getpgid(0), os.getsid(0), repr(sys.stdin.read()), flush=True)"
    proc = spawn([sys.executable, "-c", report], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    group, session, read = out.split()
    assert int(group) == proc.pid and int(session) == os.getsid(0)
    assert read == "''"  # stdin is /dev/null: a read ends at once, never waits on a terminal


_STUBBORN_CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)
_PARENT = (
    "import subprocess, sys, time\n"
    f"child = subprocess.Popen([sys.executable, '-c', {_STUBBORN_CHILD!r}],\n"
    "                         stdout=subprocess.PIPE, text=True)\n"
    "child.stdout.readline()\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("grace_s", [0.0, 1.0])
def test_stop_returns_only_when_the_whole_group_is_gone(grace_s):
    """The leader exits on SIGTERM, its child ignores it (as an engine's Worker may, for a
    while): `stop` SIGKILLs what is left after the grace, and returns with nothing of the
    group alive, not when the leader alone is reaped."""
    import subprocess
    import sys

    from millstream.bench.kit.spawn import spawn, stop
    from millstream.shared.process.lifecycle import group_processes

    proc = spawn([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert set(group_processes(proc.pid)) == {proc.pid, child}
    started = time.monotonic()
    stop(proc, grace_s=grace_s)
    assert group_processes(proc.pid) == []
    assert proc.returncode == (-15 if grace_s else -9)  # SIGTERM first, unless no grace
    assert time.monotonic() - started >= grace_s  # the stubborn child had its grace


def test_thread_wait_counts_the_time_a_busy_thread_is_kept_from_its_core():
    """Three processes that spin on one core each run a third of the time and wait for it two
    thirds: the run-queue wait the overhead benchmark records per thread
    (`threads_wait_ms_per_ktok`), not the CPU time beside it in the same file."""
    import subprocess
    import sys

    from millstream.bench.kit.procstat import thread_cpu_s, thread_wait_s, tree_thread_wait_s

    core = min(os.sched_getaffinity(0))
    spin = (
        f"import os, time\nos.sched_setaffinity(0, {{{core}}})\nt = time.monotonic()\n"
        "while time.monotonic() - t < 1.0: pass\nprint('spun', flush=True)\ninput()"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"spun\n"  # now asleep in input()
        waited = [sum(thread_wait_s(p.pid).values()) for p in procs]
        ran = [sum(thread_cpu_s(p.pid).values()) for p in procs]
        assert sum(waited) > 1.3 * sum(ran), (waited, ran)  # about 2x: each ran 1 s in 3
        tree = tree_thread_wait_s(os.getpid())
        assert sum(tree.values()) >= sum(waited)  # the children are in this process's tree
        assert set(thread_wait_s(os.getpid())) == set(thread_cpu_s(os.getpid()))  # the same names
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_thread_split_names_the_busy_thread_of_each_process():
    """bench/overhead.py says which thread pays for the hop: a named thread's CPU must land
    under its own name, and the tree's split must cover a child process's threads too."""
    import os
    import subprocess
    import sys
    import threading

    from millstream.bench.kit.procstat import thread_cpu_s, tree_thread_cpu_s

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, done = threading.Event(), threading.Event()

    def named_spin() -> None:  # the kernel's thread name, as vLLM's and ZeroMQ's threads set it
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text("busy-probe")
        spin(0.3)
        spun.set()
        done.wait(120)  # alive until the test is done reading: an ended thread leaves the split

    alive = threading.Thread(target=named_spin)
    alive.start()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(60)"]
    )
    try:
        assert spun.wait(60)
        mine = thread_cpu_s(os.getpid())
        named = [k for k in mine if k.endswith("/busy-probe")]
        assert len(named) == 1 and mine[named[0]] >= 0.25, mine
        deadline = time.monotonic() + 60
        while (child_s := sum(thread_cpu_s(child.pid).values())) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child_s >= 0.25, child_s
        tree = tree_thread_cpu_s(os.getpid())
        assert tree[named[0]] >= mine[named[0]]  # this process is in its own tree
        assert sum(tree.values()) >= sum(mine.values()) + child_s - 0.05  # the child's CPU counted
    finally:
        done.set()
        alive.join()
        child.kill()
        child.wait()


def test_pss_counts_a_forked_childs_shared_pages_once():
    """The soak reads a role's memory as PSS too: 64 MiB that a forked child shares with its
    parent count twice in the tree's RSS and once in its PSS."""
    import os
    import signal

    from millstream.bench.kit.procstat import tree_pss_bytes, tree_rss_bytes

    shared = bytearray(os.urandom(64 * 2**20))  # touched: resident before the fork
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only waits to be killed
        signal.pause()
        os._exit(0)
    try:
        time.sleep(0.2)
        rss, pss = tree_rss_bytes(os.getpid()), tree_pss_bytes(os.getpid())
        assert rss - pss >= 48 * 2**20, (rss / 2**20, pss / 2**20)
        assert pss >= len(shared)  # counted once, not zero times
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_cpu_meter_counts_a_tree_with_its_children_and_the_driver_alone():
    """CPU per unit of work between start and stop: a child that burns CPU counts with its
    parent's tree, but not with a name measured alone (the stress driver)."""
    import os
    import subprocess
    import sys

    from millstream.bench.kit.procstat import CpuMeter

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', "
            "'import time\\nwhile time.process_time() < 0.6: pass\\ntime.sleep(60)'])\n"
            "time.sleep(60)",
        ]
    )
    try:
        meter = CpuMeter({"tree": parent.pid, "driver": os.getpid()}, alone=frozenset({"driver"}))
        assert not meter.started and meter.per_unit_us() == {}
        meter.start(work=10)
        assert meter.started
        deadline = time.monotonic() + 60  # the grandchild spins 0.6 s of CPU meanwhile
        while True:
            meter.stop(work=20)
            if meter.cpu_s["tree"] >= 0.3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert meter.work == 10
        assert meter.cpu_s["tree"] >= 0.3, meter.cpu_s
        assert meter.cpu_s["driver"] < meter.cpu_s["tree"]  # its children are not its own
        assert meter.per_unit_us()["tree"] == pytest.approx(1e6 * meter.cpu_s["tree"] / 10)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()


def test_rounds_keep_a_breakdown_beside_the_numbers_they_summarize():
    """A sample may carry a breakdown (the overhead benchmark's per-thread CPU): kept per
    sample as it came, left out of the medians, which cover the numbers only."""
    from millstream.bench.kit.rounds import compare

    samples = iter([{"rate": 2, "split": {"x": 1.0}}, {"rate": 4, "split": {"x": 3.0}}])
    outcome = compare({"a": lambda: next(samples)}, rounds=2, metric="rate", say=lambda _: None)
    assert [s["split"] for s in outcome.samples["a"]] == [{"x": 1.0}, {"x": 3.0}]
    assert set(outcome.summary()["systems"]["a"]) == {"rate"}
    assert outcome.median("a") == 3.0


def test_paired_ratios_cancel_a_drift_the_ratio_of_medians_keeps():
    """The machine speeds up 3x over the run; B is 0.9 of A in two rounds of three. The medians
    fall in different rounds (A's 20 in round 2, B's 27 in round 2 or 3): their ratio says 1.35,
    the pairs say 0.9, and the pairs' spread is recorded beside the ratio of medians."""
    from millstream.bench.kit.rounds import compare

    speed = iter([10, 9, 27, 20, 30, 27])  # round 1 a, b; round 2 b, a (order flips); round 3 a, b
    outcome = compare(
        {"a": lambda: {"rate": next(speed)}, "b": lambda: {"rate": next(speed)}},
        rounds=3,
        metric="rate",
        say=lambda _: None,
    )
    assert [s["rate"] for s in outcome.samples["b"]] == [9, 27, 27]
    assert outcome.paired_ratios()["b"] == pytest.approx([0.9, 1.35, 0.9])
    assert outcome.paired_ratios()["a"] == [1.0, 1.0, 1.0]
    paired = outcome.summary()["paired_ratios"]["b"]
    assert (paired["median"], paired["min"], paired["max"]) == pytest.approx((0.9, 0.9, 1.35))
    assert outcome.ratios()["b"] == pytest.approx(27 / 20)


def test_pooled_runs_keep_every_round_paired_in_run_order():
    """Two runs of a comparison (engines started afresh for each) pool into one outcome whose
    pairs are the runs' pairs; runs of different systems do not pool."""
    from millstream.bench.kit.rounds import Outcome, pooled

    first = Outcome("rate", {"a": [{"rate": 10.0}], "b": [{"rate": 8.0}]})
    second = Outcome("rate", {"a": [{"rate": 20.0}, {"rate": 30.0}], "b": [{"rate": 22.0}, {"rate": 30.0}]})
    both = pooled([first, second])
    assert [s["rate"] for s in both.samples["b"]] == [8.0, 22.0, 30.0]
    assert both.paired_ratios()["b"] == pytest.approx([0.8, 1.1, 1.0])
    assert both.settings["runs"] == 2
    with pytest.raises(ValueError, match="same systems"):
        pooled([first, Outcome("rate", {"a": [{"rate": 1.0}], "c": [{"rate": 1.0}]})])


def test_overhead_names_an_unknown_system_before_any_engine_starts(capsys):
    from millstream.bench import overhead

    with pytest.raises(SystemExit):
        overhead.main(["--systems", "millstream,asyncllm-twice"])
    assert "asyncllm-twice" in capsys.readouterr().err
    assert overhead.systems_arg("asyncllm-again, millstream") == ("asyncllm-again", "millstream")


def test_overhead_starts_every_engine_afresh_per_instance_and_pools_the_rounds(tmp_path, monkeypatch):
    """`--instances 2`: every engine started twice, the second time in the opposite order,
    `--rounds` with each set, the samples pooled and each start's summary kept. The engines
    and their loads are stand-ins here (this test is about the loop; the real engines run in
    the benchmark), recording the order they were started in."""
    import json
    import signal

    from millstream.bench import overhead

    started: list[str] = []

    class Engine:
        def __init__(self, name):
            self.name, self.pid = name, os.getpid()  # with_cpu reads this process's threads

    def start(name):
        started.append(name)
        return Engine(name)

    class Awake:  # the real OneAwake would SIGSTOP these pids: this process
        def __init__(self, groups):
            pass

        def measuring(self, name, system):
            return system

        def wake_all(self):
            pass

    rates = {"asyncllm": 10.0, "millstream": 9.0, "asyncllm-again": 11.0, "vllm-serve": 5.0}

    def load_of(name):
        return lambda *args: {"tokens_s": rates[name], "tokens": 100, "wall_s": 1.0}

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    monkeypatch.setattr(overhead, "build_tiny_model", lambda out, seed: model)
    monkeypatch.setattr(overhead, "start_actor", lambda stack, cfg, path, work: start("millstream"))
    monkeypatch.setattr(overhead, "start_asyncllm", lambda stack, cfg, path, work, name: start(name))
    monkeypatch.setattr(overhead, "start_vllm_serve", lambda stack, cfg, work: (start("vllm-serve"), "url"))
    monkeypatch.setattr(overhead, "lower_baseline_cores", lambda cfg, procs: None)
    monkeypatch.setattr(overhead, "OneAwake", Awake)
    monkeypatch.setattr(overhead, "through_millstream", load_of("millstream"))
    monkeypatch.setattr(overhead, "through_vllm_serve", load_of("vllm-serve"))
    monkeypatch.setattr(overhead, "through_asyncllm", lambda engine, load: load_of(engine.name)())
    monkeypatch.setattr(overhead, "results_dir", lambda: tmp_path / "results")
    handler = signal.getsignal(signal.SIGTERM)
    try:
        systems = "millstream,vllm-serve,asyncllm-again"
        argv = ["--quick", "--shapes", "waves", "--rounds", "2", "--instances", "2", "--systems", systems]
        assert overhead.main(argv) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    forwards = ["millstream", "asyncllm", "asyncllm-again", "vllm-serve"]
    assert started == forwards + forwards[::-1]
    result = orjson.loads((tmp_path / "results" / "overhead-waves-c64-quick.json").read_bytes())
    assert len(result["per_instance"]) == 2 and result["settings"]["runs"] == 2
    assert {name: len(samples) for name, samples in result["samples"].items()} == dict.fromkeys(
        ["asyncllm", "millstream", "vllm-serve", "asyncllm-again"], 4
    )
    assert result["summary"]["ratios"]["millstream"] == pytest.approx(0.9)
    assert result["summary"]["paired_ratios"]["vllm-serve"]["median"] == pytest.approx(0.5)


@pytest.mark.real
def test_pool_vs_http_plays_both_sides_against_the_same_engine(tmp_path):
    """envpool (real worker + synthetic actor) and the asyncio + HTTP baseline (the synthetic
    actor's engine over aiohttp) both finish every episode and report their rates."""
    import subprocess
    import sys

    # Its own process: the stress driver binds with its run's keys, and a process serves one
    # run's keys (shared/wire/keys.py), so running it here would refuse later tests' keys.
    args = ["--concurrency", "16", "--episodes", "64", "--rounds", "1", "--out", str(tmp_path)]
    subprocess.run([sys.executable, "-m", "millstream.bench.pool_vs_http", *args], check=True, timeout=600)
    result = orjson.loads((tmp_path / "pool-vs-http-c16.json").read_bytes())
    for system in ("envpool", "asyncio-http"):
        (sample,) = result["samples"][system]
        assert sample["turns_s"] > 0 and sample["turns_s_wall"] > 0 and sample["p99_ms"] > 0
    assert (tmp_path / "pool-vs-http-c16.png").stat().st_size > 0


def test_the_kit_finds_the_results_folder_and_the_repository():
    """bench/kit/ sits one folder below bench/: its paths must not move with it."""
    from millstream.bench.kit import replicas, rounds

    assert rounds.RESULTS == ROOT / "bench" / "results" and rounds.RESULTS.is_dir()
    assert replicas.ROOT == ROOT and (replicas.ROOT / "pyproject.toml").is_file()


def test_real_model_summary_reads_eval_and_step_split(tmp_path):
    """bench/learning/real_model.py's numbers come from a run's metrics.jsonl: the eval at version 0 and
    the last, the step split over steps after the first, rolled-back steps left out; and every
    variant's settings pass the config check on the example."""
    from millstream.bench.learning import real_model

    def step(n, **extra):
        return {"step": n, "reward/mean": 0.1 * n, "perf/step_s": 10.0 * n, "train/step_time_s": 4.0,
                "sync/total_s": 1.0, "sync/actor_paused_s": 0.5, "train/tokens": 100.0,
                "perf/elapsed_s": 10.0 * n, "fleet/actor/tokens": 300.0 * n, **extra}  # fmt: skip

    records = [
        {"eval/version": 0, "eval/success": 0.25},
        step(1),
        step(2),
        step(3, rolled_back=True),
        step(3),
        {"eval/version": 3, "eval/success": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in records))
    s = real_model.summarize_run(tmp_path)
    assert (s["eval_start"], s["eval_end"], s["eval_end_version"], s["steps"]) == (0.25, 0.5, 3, 3)
    assert s["eval_rise"] == pytest.approx(0.25)
    assert s["step_s"] == 25.0 and s["train_s"] == 4.0 and s["wait_s"] == 20.0  # median of steps 2, 3
    assert s["generated_tokens_per_s"] == 30.0 and s["trained_tokens_per_s"] == pytest.approx(10.0)
    for overrides in real_model.VARIANTS.values():
        check_config(load_config(real_model.CONFIG, overrides))


def test_scratch_is_removed_after_a_clean_exit_and_kept_with_its_path_after_a_failure(capsys):
    """A benchmark's scratch folder goes when its numbers are in; when it fails, the engine logs
    in it are the account of why, so it stays and its path is printed."""
    from millstream.bench.kit.scratch import scratch

    with scratch("millstream-test-scratch-") as work:
        (work / "engine.log").write_text("fine")
    assert not work.exists()
    with pytest.raises(RuntimeError, match="engine died"), scratch("millstream-test-scratch-") as kept:
        (kept / "engine.log").write_text("why it died")
        raise RuntimeError("engine died")
    try:
        assert (kept / "engine.log").read_text() == "why it died"
        assert str(kept) in capsys.readouterr().err
    finally:
        shutil.rmtree(kept)

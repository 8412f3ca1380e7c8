"""`millstream stress` (bench/stress.py) end to end, with a third-party environment.

The environment is `coinflip` from tests/plugin: a package that imports only
`envpool.envs.base` (Observation, StepResult), never calls `register`, and is found through the
`millstream.envs` entry point of its hand-written `.dist-info`, exactly as an installed package
would be. With tests/plugin on PYTHONPATH the stress run must take it unchanged; without it, the
same name must be a fast, clear error (exit 2) before any process starts.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from millstream.bench.stress import parse_faults

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "plugin"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPISODES = 400
FAULTS = "crash=0.05,hang=0.02,garbage=0.1"


def _env(with_plugin: bool) -> dict[str, str]:
    """os.environ with tests/plugin first on PYTHONPATH, or removed from it."""
    parts = [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != PLUGIN
    ]
    if with_plugin:
        parts.insert(0, str(PLUGIN))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    return env


def _stress(args: list[str], *, with_plugin: bool, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "millstream.bench.stress", *args],
        cwd=ROOT,
        env=_env(with_plugin),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- the plugin package itself ----------------------------------------------------------------


def _load_plugin_module():
    """The plugin module, loaded from its file: no sys.path change, so no entry point leaks into
    this test process (its REGISTRY stays as millstream alone makes it)."""
    spec = importlib.util.spec_from_file_location(
        "_coinflip_under_test", PLUGIN / "millstream_demo_plugin" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plugin_imports_only_the_documented_interface():
    tree = ast.parse((PLUGIN / "millstream_demo_plugin" / "__init__.py").read_text())
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("millstream")
        for alias in node.names
    }
    plain = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported == {
        ("millstream.envpool.envs.base", "Observation"),
        ("millstream.envpool.envs.base", "StepResult"),
    }
    assert not any(
        name.split(".")[0] in ("millstream", "envpool", "shared", "actor", "learner", "bench")
        for name in plain
    )
    entry = (PLUGIN / "millstream_demo_plugin-0.1.dist-info" / "entry_points.txt").read_text()
    assert "[millstream.envs]" in entry and "coinflip = millstream_demo_plugin:CoinFlip" in entry


def test_coinflip_rules_deterministic_anchors_and_format_penalty():
    CoinFlip = _load_plugin_module().CoinFlip

    async def play(seed: int, replies: list[str]):
        env = CoinFlip()
        obs = await env.reset(seed)
        out: list[tuple] = [(obs.anchor, None)]
        for reply in replies:
            result = await env.step(reply)
            out.append(
                (
                    result.observation.anchor,
                    result.reward,
                    result.done,
                    result.info.get("valid"),
                    result.info.get("coin"),
                )
            )
        return out

    # Same seed, same coins (GRPO groups share a seed); anchors name the state.
    a = asyncio.run(play(7, ["<answer>heads</answer>", "<answer>tails</answer>"]))
    b = asyncio.run(play(7, ["<answer>heads</answer>", "<answer>tails</answer>"]))
    assert a == b
    assert [step[0] for step in a] == ["coin0", "coin1", "done"]
    assert [step[2] for step in a[1:]] == [False, True]
    coins = [step[4] for step in a[1:]]
    assert set(coins) <= {"heads", "tails"}
    assert [step[3] for step in a[1:]] == [True, True]
    assert [step[1] for step in a[1:]] == [float(coins[0] == "heads"), float(coins[1] == "tails")]
    # Across seeds both faces occur (the seed really decides the coins).
    faces = {
        step[4] for seed in range(20) for step in asyncio.run(play(seed, ["<answer>heads</answer>"]))[1:]
    }
    assert faces == {"heads", "tails"}
    # An unparseable reply: format penalty, valid=False, and the episode goes on.
    bad = asyncio.run(play(3, ["\x00\ufffd#!garbage!#\ufffd", "no tags here"]))
    assert [step[1:4] for step in bad[1:]] == [(-0.1, False, False), (-0.1, True, False)]


def test_entry_point_alone_registers_the_plugin():
    code = (
        "import importlib.metadata as md, millstream.envpool.envs as e\n"
        "from millstream.envpool.envs.base import REGISTRY\n"
        "assert 'coinflip' not in REGISTRY, 'registered before the entry points were read'\n"
        "assert md.distribution('millstream-demo-plugin').version == '0.1'\n"
        "names = e.env_names()\n"
        "assert 'coinflip' in names and 'echo' in names, names\n"
        "cls = REGISTRY['coinflip']\n"
        "assert (cls.__module__, cls.__name__) == ('millstream_demo_plugin', 'CoinFlip')\n"
        "print('OK', type(e.make_env('coinflip', {'flips': 1})).__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(True), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK CoinFlip"


# --- the stress run ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stress_run(tiny_model_dir, tmp_path_factory):
    """One `millstream stress` run of the plugin env with all three faults, two envpool worker
    processes sharing the actor; (process, out dir).

    Faults are drawn per reset/step call: crash 0.05, hang 0.02 (a hang outlives
    `envpool.step_timeout_s=1`, so it ends as env_timeout). A coinflip episode makes up to 3
    calls (reset, 2 steps), each ending it by a crash with 0.05, a hang with 0.02, else going on
    (0.93). P(an episode sees no hang) = 0.05 + 0.93 * (0.05 + 0.93 * 0.98) = 0.944, so
    P(no env_timeout in 400 episodes) = 0.944**400 ~ 1e-10; for crashes 0.860**400 ~ 1e-26. Even
    counting only the 400 resets, 0.98**400 ~ 3e-4. And faults are seeded (run.seed), so the
    pattern barely varies between runs anyway.
    """
    out = tmp_path_factory.mktemp("stress") / "coinflip"
    proc = _stress(
        [
            "--env",
            "coinflip",
            "--episodes",
            str(EPISODES),
            "--concurrency",
            "200",
            "--workers",
            "2",
            "--actor",
            "synthetic",
            "--faults",
            FAULTS,
            "--out",
            str(out),
            "--set",
            f"model.path={tiny_model_dir}",
            "--set",
            "envpool.step_timeout_s=1",
        ],
        with_plugin=True,
        timeout=180,
    )
    return proc, out


def _report(stress_run) -> dict:
    proc, out = stress_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return orjson.loads((out / "report.json").read_bytes())


def test_stress_accounts_for_every_episode(stress_run):
    report = _report(stress_run)
    e, failures = report["episodes"], report["failures_by_cause"]
    assert report["lost"] == 0
    assert report["not_started"] == 0
    assert e["asked"] == e["started"] == EPISODES
    assert e["completed"] + sum(failures.values()) == EPISODES
    assert e["failed"] == sum(failures.values()) and e["accounted"] == EPISODES
    assert report["faults"] == {"crash": 0.05, "hang": 0.02, "garbage": 0.1}
    # Both workers ran episodes (group numbers alternate between them) and reported their ends.
    assert set(report["memory"]) == set(report["sockets"]) == {"w0", "w1"}
    assert all(m["peak_live"] > 0 for m in report["memory"].values())


def test_stress_failures_have_causes(stress_run):
    failures = _report(stress_run)["failures_by_cause"]
    # Injected faults are env failures only: the synthetic actor and the runner never fail here.
    assert set(failures) == {"env_error", "env_timeout"}, failures
    assert failures["env_error"] > 0 and failures["env_timeout"] > 0
    # Expected about 14% and 6% of episodes; far outside means the fault path is broken.
    assert 20 <= failures["env_error"] <= 120, failures
    assert 5 <= failures["env_timeout"] <= 60, failures


def test_stress_turns_invalid_actions_and_latency(stress_run):
    report = _report(stress_run)
    completed = report["episodes"]["completed"]
    assert completed > 0
    # Every completed coinflip episode plays both coins (1024-token context, 24 tokens a turn).
    assert report["turns"] == 2 * completed
    # Synthetic replies are random tokens, and garbage faults add unparseable ones.
    assert 0 < report["invalid_actions"] <= report["turns"]
    lat = report["turn_latency_s"]
    assert all(isinstance(lat[k], float) and lat[k] > 0 for k in ("p50", "p95", "p99", "mean")), lat
    assert lat["p50"] <= lat["p95"] <= lat["p99"]
    assert lat["count"] >= report["turns"]  # a turn whose env step then failed still generated
    assert report["peak_live"] > 0
    assert report["timeline"], "no per-second statistics"


def test_stress_outputs_plot_config_and_table(stress_run):
    proc, out = stress_run
    _report(stress_run)
    png = out / "stress.png"
    assert png.exists() and png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000
    config = (out / "config.toml").read_text()
    assert 'env = "flaky"' in config and 'inner = "coinflip"' in config
    assert (out / "envpool-w0.jsonl").stat().st_size > 0
    lost_rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("LOST")]
    assert lost_rows == [["LOST", "0"]], proc.stdout[-2000:]
    assert f"{EPISODES} asked, {EPISODES} started" in proc.stdout
    assert "failed: env_error" in proc.stdout and "failed: env_timeout" in proc.stdout


# --- fast failures ----------------------------------------------------------------------------


def test_unknown_env_without_the_plugin_fails_fast(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    # Through the `millstream stress` command itself (shared/launch/cli.py execs bench.stress).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "millstream.shared.launch.cli",
            "stress",
            "--env",
            "coinflip",
            "--episodes",
            "16",
            "--faults",
            FAULTS,
            "--out",
            str(out),
            "--set",
            f"model.path={tiny_model_dir}",
        ],
        cwd=ROOT,
        env=_env(False),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "unknown environment 'coinflip'" in proc.stderr
    known = proc.stderr.split("known:", 1)[1]
    assert "echo" in known and "flaky" in known and "coinflip" not in known
    assert "Traceback" not in proc.stderr
    # Nothing was started: no actor, no worker, no report.
    assert not any(out.glob("*.log")) and not (out / "report.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--faults", "crash=2"], "crash=2.0 is not a probability in [0, 1]"),
        (["--faults", "boom=0.1"], "'boom=0.1' is not NAME=P with NAME one of crash, hang, garbage"),
        (["--episodes", "10", "--group-size", "8"], "--episodes 10 is not a multiple of --group-size 8"),
        (["--concurrency", "4", "--group-size", "8", "--episodes", "16"], "fewer than one group of 8"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(tiny_model_dir, tmp_path, args, message):
    out = tmp_path / "out"
    proc = _stress(
        ["--env", "echo", "--out", str(out), "--set", f"model.path={tiny_model_dir}", *args],
        with_plugin=False,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("millstream stress: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(out.glob("*.log"))


def test_bad_env_args_exit_2_with_a_clear_message(tiny_model_dir, tmp_path):
    proc = _stress(
        [
            "--env",
            "echo",
            "--episodes",
            "16",
            "--out",
            str(tmp_path / "out"),
            "--set",
            f"model.path={tiny_model_dir}",
            "--set",
            "envpool.env_args={bogus = 1}",
        ],
        with_plugin=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "rejected envpool.env_args" in proc.stderr and "Traceback" not in proc.stderr


# --- parse_faults -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", {}),
        ("crash=0.01", {"crash": 0.01}),
        ("crash=0.01,hang=0.02,garbage=0.05", {"crash": 0.01, "hang": 0.02, "garbage": 0.05}),
        (" crash=0.1 , garbage=0 ,", {"crash": 0.1, "garbage": 0.0}),
        ("hang=1", {"hang": 1.0}),
        ("crash=0.5,hang=0.5", {"crash": 0.5, "hang": 0.5}),
        ("crash=1e-3", {"crash": 0.001}),
    ],
)
def test_parse_faults_accepts(text, expected):
    assert parse_faults(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("crash", "is not NAME=P"),
        ("boom=0.1", "is not NAME=P with NAME one of crash, hang, garbage"),
        ("Crash=0.1", "is not NAME=P"),
        ("=0.1", "is not NAME=P"),
        ("crash=abc", "crash='abc' is not a number"),
        ("crash=", "is not a number"),
        ("crash=2", "not a probability in [0, 1]"),
        ("hang=-0.1", "not a probability in [0, 1]"),
        ("garbage=nan", "not a probability in [0, 1]"),
        ("crash=inf", "not a probability in [0, 1]"),
        ("crash=0.6,hang=0.6", "sum to 1.2 > 1"),
        ("crash=0.5,hang=0.3,garbage=0.3", "> 1"),
    ],
)
def test_parse_faults_rejects(text, message):
    with pytest.raises(ValueError, match="^--faults: ") as info:
        parse_faults(text)
    assert message in str(info.value)


def _three(combo) -> str:
    return ",".join(f"{n}={p!r}" for n, p in zip(("crash", "hang", "garbage"), combo))


def test_parse_faults_accepts_probabilities_summing_to_one():
    for combo in ((0.1, 0.2, 0.7), (0.7, 0.2, 0.1), (0.05, 0.15, 0.8), (1 / 3, 1 / 3, 1 / 3)):
        assert math.isclose(sum(parse_faults(_three(combo)).values()), 1.0)


def test_parse_faults_sum_check_tolerates_float_rounding():
    assert 0.33 + 0.56 + 0.11 > 1  # the float rounding this test is about
    assert parse_faults(_three((0.33, 0.56, 0.11))) == {"crash": 0.33, "hang": 0.56, "garbage": 0.11}


def test_importing_the_stress_module_leaves_no_folder_behind(tmp_path):
    """The keys folder of `stress_once` is made on first use and removed at exit: importing the
    module (every test process and `millstream stress` does) used to leave one in /tmp each time."""
    script = "import millstream.bench.stress as s; print(s._shared_keys().parent)"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", "import millstream.bench.stress"], env=env, check=True, timeout=60)
    assert list(tmp_path.iterdir()) == [], "importing the module made a folder"
    made = subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, timeout=60, capture_output=True, text=True
    ).stdout.strip()
    assert made.startswith(str(tmp_path)), made
    assert not Path(made).exists(), f"{made} was left behind at exit"

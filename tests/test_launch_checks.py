"""Errors before anything starts: each bad input stops `millstream run` with one line naming the
key, exit status 2, no run directory and no role process.

Most cases go through `launcher.prepare`, the very function `millstream run` calls before it
makes anything; a few go through the command itself, to check the plumbing (usage, exit status,
one line on stderr, nothing left on disk).
"""

import subprocess
from pathlib import Path

import pytest
from helpers import MILLSTREAM, ROOT

from millstream.shared.config import ConfigError, load_config
from millstream.shared.launch.launcher import prepare
from millstream.shared.process.lifecycle import ENV_RUN


def refused(tmp_path: Path, *overrides: str) -> str:
    root = tmp_path / "runs"
    with pytest.raises(ConfigError) as caught:
        prepare(None, [f"run.root={root}", *overrides])
    assert not root.exists(), "a run directory was made before the check failed"
    return str(caught.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "envpool.env=frozenlak",
            "envpool.env = 'frozenlak': unknown environment 'frozenlak'; did you mean 'frozenlake'?",
        ),
        (
            "envpool.env_args={no_such_arg=1}",
            "envpool.env_args: environment 'evenchars' rejected envpool.env_args={'no_such_arg': 1}",
        ),
        (
            "envpool.max_tokens=1010",
            "envpool.max_tokens = 1010: the first prompt of 'evenchars' (seed 17) has 18 tokens",
        ),
    ],
)
def test_the_envpool_check_runs_before_anything_starts(tmp_path, tiny_model_dir, override, message):
    assert refused(tmp_path, f"model.path={tiny_model_dir}", override).startswith(message)


@pytest.mark.slow
def test_lora_targets_the_model_lacks_are_refused_before_anything_starts(tmp_path, tiny_model_dir):
    message = refused(
        tmp_path,
        f"model.path={tiny_model_dir}",
        "learner.lora_rank=4",
        "learner.lora_target_modules=['q_proj','qkv']",
    )
    assert message.startswith("learner.lora_target_modules: ['qkv'] match no linear layer")


@pytest.mark.parametrize(
    "override, message",
    [
        ("envpool.temperature=0", "envpool.temperature = 0: greedy samples cannot be trained on"),
        (
            "envpool.top_p=0.9",
            "envpool.top_p = 0.9: the learner trains the distribution at envpool.temperature",
        ),
    ],
)
def test_sampling_the_learner_cannot_train_on_is_refused_before_anything_starts(
    tmp_path, tiny_model_dir, override, message
):
    """The learner trains softmax(logits / temperature) over the whole vocabulary: greedy or
    nucleus samples are not drawn from it, and would be trained on as if they were."""
    assert refused(tmp_path, f"model.path={tiny_model_dir}", override).startswith(message)


def test_a_learner_started_alone_refuses_such_sampling_too(tiny_model_dir):
    """`millstream learner --check` (and the learner's own start) runs the same check."""
    from millstream.learner.main import check_learner
    from millstream.shared.config import load_config

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "envpool.top_p=0.5"])
    assert (check_learner(cfg) or "").startswith("envpool.top_p = 0.5: the learner trains")
    assert (
        check_learner(load_config(None, [f"model.path={tiny_model_dir}", "envpool.temperature=0.7"])) is None
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor.address=tcp://localhost:5555", "learner.version_address=tcp://127.0.0.1:5555"],
            "actor.address = 'tcp://localhost:5555': learner.version_address binds it too",
        ),
        (
            [
                "actor.replicas=2",
                "actor.address=tcp://127.0.0.1:5600",
                "learner.experience_address=tcp://127.0.0.1:5601",
            ],
            "actor.replica_addresses[1] = 'tcp://127.0.0.1:5601': learner.experience_address binds it too",
        ),
        (
            ["train.groups_per_batch=5000"],
            "train.groups_per_batch = 5000: a batch takes 5000 complete groups",
        ),
        (["run.name=../../escape"], "run.name = '../../escape': expected a folder name"),
        (["judge.weight=nan"], "judge.weight = nan: expected a number"),
        (["actor.max_model_len=100000"], "actor.max_model_len = 100000: more than the model's context (4096"),
    ],
)
def test_settings_that_could_only_fail_later_are_refused_now(tmp_path, tiny_model_dir, overrides, message):
    """A bad-input audit's finds: two roles on one address (the second failed at its bind, after
    its engine loaded), a batch larger than the buffer (no step, ever), a run name that leaves
    run.root, a NaN that passes every range check, a context longer than the model's (vLLM's
    refusal came as its engine started, and again at each restart)."""
    assert refused(tmp_path, f"model.path={tiny_model_dir}", *overrides).startswith(message)


def test_a_config_path_that_is_no_file_or_comes_last_is_one_line(tmp_path):
    from millstream.shared.config import load_config

    (tmp_path / "latin1.toml").write_bytes("name = 'caf\xe9'".encode("latin-1"))
    for path, said in (
        (tmp_path, "cannot read the config file"),
        (tmp_path / "latin1.toml", "not UTF-8 text"),
    ):
        with pytest.raises(ConfigError, match=said):
            load_config(str(path))
    (tmp_path / "my.toml").write_text("")
    proc = subprocess.run(
        [*MILLSTREAM, "run", "train.steps=5", str(tmp_path / "my.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "looks like a config file: it comes first" in proc.stderr, proc.stderr


def test_evaluation_of_an_agent_env_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    message = refused(tmp_path, f"model.path={tiny_model_dir}", "envpool.env=openai_agent", "eval.every=5")
    assert message.startswith("eval.every = 5: evaluation rounds play text environments")


def test_a_model_path_that_is_not_a_model_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert refused(tmp_path, f"model.path={tmp_path / 'empty'}") == (
        f"model.path = '{tmp_path / 'empty'}': not a model directory millstream can use (no config.json, "
        "tokenizer.json, tokenizer_config.json)"
    )
    assert refused(tmp_path, f"model.path={tmp_path / 'nowhere'}").endswith("not a directory")


def test_a_resume_from_nowhere(tmp_path, tiny_model_dir):
    message = refused(tmp_path, f"model.path={tiny_model_dir}", f"run.resume={tmp_path / 'gone'}")
    assert message.startswith(f"run.resume = '{tmp_path / 'gone'}': no checkpoint at")


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.steps"], "override 'train.steps' needs '=': write train.steps=VALUE"),
        (['train.steps="8"'], 'train.steps = "8": expected int, got str'),
        (
            ["actor.device=tpu"],
            "actor.device = \"tpu\": expected one of 'auto', 'cpu', 'cuda'; did you mean 'cpu'?",
        ),
        (["envpool.temperature=3"], "envpool.temperature = 3: expected float <= 2.0"),
        (["envpool.env=frozenlak"], "envpool.env = 'frozenlak': unknown environment"),
        (
            ["actor.tensor_parallel_size=3"],
            "actor.tensor_parallel_size = 3: must divide the model's 4 attention heads",
        ),
    ],
)
def test_the_command_says_one_line_and_starts_nothing(tmp_path, tiny_model_dir, args, message):
    root = tmp_path / "runs"
    proc = subprocess.run(
        [*MILLSTREAM, "run", f"run.root={root}", f"model.path={tiny_model_dir}", *args]
        if "=" in args[0]
        else [*MILLSTREAM, "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"millstream run: {message}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == "" and not root.exists()
    assert not list(Path("/proc").glob("*/environ")) or _no_run_process(root)


@pytest.mark.parametrize("key", ["actor.address", "learner.experience_address", "learner.version_address"])
def test_a_busy_address_fails_at_once_naming_its_key(tmp_path, tiny_model_dir, key):
    """A port another process listens on: one line naming the key, well before any role starts
    (it took 126-137 s and three actor restarts before), and no run directory."""
    import socket
    import time

    root = tmp_path / "runs"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        started = time.monotonic()
        proc = subprocess.run(
            [*MILLSTREAM, "run", f"run.root={root}", f"model.path={tiny_model_dir}", f"{key}={address}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"millstream run: {key} = '{address}': another process already listens")
    assert len(proc.stderr.strip().splitlines()) == 1 and not root.exists()
    assert took < 60, took  # a bound, not a benchmark: the failure it replaces took over 120 s


def test_a_connected_actor_address_is_not_bind_checked(tiny_model_dir):
    """actor.connect: the launcher starts no actor, so only the learner's addresses are its to bind."""
    from millstream.shared.config import load_config
    from millstream.shared.launch.preflight import bind_addresses

    cfg = load_config(None, ["actor.connect=tcp://127.0.0.1:5555", "judge.model_path=x"])
    assert [key for key, _ in bind_addresses(cfg)] == [
        "learner.experience_address",
        "learner.version_address",
        "judge.address",
    ]
    cfg = load_config(
        None, ["actor.replicas=2", 'actor.replica_addresses=["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"]']
    )
    assert [key for key, _ in bind_addresses(cfg)][2:] == [
        "actor.replica_addresses[0]",
        "actor.replica_addresses[1]",
    ]


def _no_run_process(root: Path) -> bool:
    """No process anywhere carries a run directory under `root` in its environment."""
    marker = f"{ENV_RUN}={root}".encode()
    for environ in Path("/proc").glob("*/environ"):
        try:
            if marker in environ.read_bytes():
                return False
        except OSError:
            continue
    return True


def test_help_prints_usage_and_every_key():
    proc = subprocess.run(
        [*MILLSTREAM, "run", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: millstream run [CONFIG.toml]")
    for key in ("[train]", "  steps = 40", "  temperature = 1.0", "  start_timeout_s = 900.0"):
        assert key in proc.stdout


def config_of(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MILLSTREAM, "config", *words], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_config_shows_a_section_a_key_or_the_keys_a_word_matches():
    headers = [line for line in config_of("learner").stdout.splitlines() if line.startswith("[")]
    assert headers == ["[learner]"]  # not [envpool] for learner_silence_timeout_s
    one = config_of("learner.lr").stdout.splitlines()
    assert one[:2] == ["[learner]", "  lr = 0.004"] and len(one) == 3  # the key and its doc line
    matched = config_of("timeout").stdout
    assert "[envpool]\n  step_timeout_s = 30.0" in matched and "[learner]" in matched
    assert "  lr = " not in matched
    nothing = config_of("no_such_word")
    assert nothing.returncode == 2 and "no key matches 'no_such_word'" in nothing.stderr
    assert config_of().stdout.count("\n[") >= 8  # every section, as before


@pytest.mark.parametrize("args", [["--version"], ["run", "--version"], ["actor", "--version"]])
def test_every_command_answers_version(args):
    from importlib.metadata import version

    proc = subprocess.run([*MILLSTREAM, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"millstream {version('millstream')}\n", proc


def test_stress_help_shows_the_defaults():
    proc = subprocess.run(
        [*MILLSTREAM, "stress", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for option in ("(default: 2000)", "(default: 500)", "(default: echo)"):
        assert option in " ".join(proc.stdout.split()), proc.stdout


@pytest.mark.parametrize("args", [["--help"], ["config"], ["run", "--help"]])
def test_output_cut_short_by_the_reader_ends_quietly(args):
    """`millstream config | head`: the reader closes the pipe after one line; no traceback."""
    proc = subprocess.Popen([*MILLSTREAM, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and first and "Traceback" not in err, err


def test_a_run_directory_that_holds_a_run_is_not_reused_by_accident(tmp_path, tiny_model_dir):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.toml").write_text("")
    with pytest.raises(ConfigError) as caught:
        prepare(None, [f"model.path={tiny_model_dir}", f"run.dir={old}"])
    assert str(caught.value) == (
        f"run.dir = '{old}': already holds a run; resume it with run.resume={old}, or choose another run.dir"
    )


def test_the_launcher_gives_every_replica_its_own_address(tiny_model_dir):
    from millstream.shared.launch.launcher import _replica_addresses
    from millstream.shared.wire.replicas import replica_address, replica_name

    free = load_config(None, ["actor.replicas=3"])
    picked = _replica_addresses(free)
    assert len(set(picked)) == 3 and all(a.startswith("tcp://127.0.0.1:") for a in picked)
    fixed = load_config(None, ["actor.replicas=3", "actor.address=tcp://127.0.0.1:7000"])
    assert _replica_addresses(fixed) == [f"tcp://127.0.0.1:{7000 + i}" for i in range(3)]
    pinned = load_config(
        None, ["actor.replicas=2", f"actor.replica_addresses={picked[:2]!r}".replace("'", '"')]
    )
    assert [replica_address(pinned, i) for i in range(2)] == picked[:2]
    assert [replica_name(i) for i in range(3)] == ["actor", "actor-1", "actor-2"]


def test_a_broken_stdout_stops_the_run_and_falls_silent():
    """The launcher's stdout (shared/launch/output.py): its reader gone, the first write stops
    the run as Ctrl-C does and nothing after raises, the stream's own last flush included."""
    import os
    import threading

    from millstream.shared.launch.output import RunOutput

    read, write = os.pipe()
    os.close(read)  # the reader left
    stream, stop = os.fdopen(write, "w"), threading.Event()
    out = RunOutput(stream, stop)
    print("step 1", file=out, flush=True)
    assert stop.is_set() and out.broken
    print("step 2", file=out, flush=True)  # dropped
    stream.write("at exit")
    stream.flush()  # now /dev/null: the interpreter's last flush cannot fail
    stream.close()


def test_the_ports_a_launcher_picks_never_coincide():
    """The launcher picks every port of a run before any role binds one, so each pick is still
    free at the next: two random picks once put a run's experience and version addresses on one
    port, and its learner failed at its bind. 400 picks from about 12,800 ports would coincide
    about six times by chance."""
    from millstream.shared.process.runtime import free_port

    picked = [free_port() for _ in range(400)]
    assert len(set(picked)) == len(picked)


def test_the_envpool_check_s_warnings_reach_the_launcher_s_log(tmp_path, tiny_model_dir, caplog):
    # The check runs in a child process; its warnings went to a stderr nobody read.
    caplog.set_level("WARNING", logger="launcher")
    prepare(None, [f"run.root={tmp_path}", f"model.path={tiny_model_dir}", "envpool.env=pytool",
                   'envpool.env_args={sandbox="weak"}'])  # fmt: skip
    said = [r.getMessage() for r in caplog.records if r.name == "launcher"]
    warning = "envpool's check: pytool: sandbox = 'weak': the policy's code is NOT isolated from this machine"
    assert warning in said

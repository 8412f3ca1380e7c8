"""Config loading: overrides, strict errors that name the key, and the resolved dump."""

import tomllib
from pathlib import Path

import msgspec
import pytest

from millstream.shared.config import (
    Config,
    ConfigError,
    describe_config,
    dump_config,
    load_config,
    parse_overrides,
)


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        None,
        [
            "train.steps=5",
            "envpool.env=bandit",
            "learner.lr=0.01",
            "envpool.env_args={swap_names=true}",
            'run.name="x y"',
        ],
    )
    assert cfg.train.steps == 5 and cfg.envpool.env == "bandit" and cfg.learner.lr == 0.01
    assert cfg.envpool.env_args == {"swap_names": True}
    assert cfg.run.name == "x y"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 7\ngroup_size = 4\n")
    cfg = load_config(path, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.group_size) == (9, 4)


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.stepz=3"], "unknown key 'train.stepz'; did you mean 'train.steps'?"),
        (["trian.steps=3"], "unknown key 'trian'; did you mean 'train'?"),
        (["nosuch.key=1"], "unknown key 'nosuch'"),
        (["train.group_size=1"], "train.group_size = 1: expected int >= 2"),
        (["actor.tensor_parallel_size=0"], "actor.tensor_parallel_size = 0: expected int >= 1"),
        (["train.steps=many"], 'train.steps = "many": expected int, got str'),
        (["learner.lr=-1"], "learner.lr = -1: expected float > 0.0"),
        (["train"], "override 'train' needs '=': write train=VALUE"),
        (["=3"], "override '=3': expected dotted.key=value"),
        (["learner.advantage=ppo"], "learner.advantage = \"ppo\": expected one of 'grpo', 'drgrpo'"),
        # Types are not coerced.
        (
            ['train.steps="8"'],
            'train.steps = "8": expected int, got str (write numbers and booleans without quotes)',
        ),
        (["train.steps=8.0"], "train.steps = 8.0: expected int, got float"),
        (['envpool.temperature="0.5"'], 'envpool.temperature = "0.5": expected float, got str'),
        (["run.name=123"], "run.name = 123: expected str, got int (quote text"),
        # Choices outside their set, with a did-you-mean where one is close.
        (
            ["actor.device=tpu"],
            "actor.device = \"tpu\": expected one of 'auto', 'cpu', 'cuda'; did you mean 'cpu'?",
        ),
        (
            ["learner.sync_backend=carrier-pigeon"],
            "learner.sync_backend = \"carrier-pigeon\": expected one of 'auto', 'gloo', 'nccl'",
        ),
        (
            ["model.dtype=float64"],
            "model.dtype = \"float64\": expected one of 'float32', 'bfloat16', 'float16'",
        ),
        (["run.log_level=LOUD"], "run.log_level = \"LOUD\": expected one of 'DEBUG', 'INFO'"),
        (  # a list's element: named by its index and shown, not `= None`
            ['metrics.backends=["jsonl", "tensorbord"]'],
            "metrics.backends[1] = \"tensorbord\": expected one of 'jsonl', 'tensorboard', 'wandb'; "
            "did you mean 'tensorboard'?",
        ),
        # What the engine would refuse, and what spans keys.
        (["envpool.temperature=2.5"], "envpool.temperature = 2.5: expected float <= 2.0"),
        (["actor.address=localhost:5555"], 'actor.address = "localhost:5555": expected tcp://HOST:PORT'),
        (["actor.connect=tcp://127.0.0.1:99999"], 'actor.connect = "tcp://127.0.0.1:99999": expected'),
        (["learner.version_address=udp://x:1"], 'learner.version_address = "udp://x:1": expected'),
        (
            ["envpool.max_tokens=1024"],
            "envpool.max_tokens = 1024: a turn's generation budget must "
            "leave room for its prompt within actor.max_model_len = 1024",
        ),
        (
            ["train.group_size=16", "envpool.max_concurrent_episodes=8"],
            "train.group_size = 16: exceeds envpool.max_concurrent_episodes = 8",
        ),
        # The fleet: one address per replica, none twice; extra replicas of a connected actor
        # join by hand.
        (
            ["actor.replicas=3", 'actor.replica_addresses=["tcp://127.0.0.1:5001"]'],
            "actor.replica_addresses lists 1 addresses for actor.replicas = 3",
        ),
        (
            ["actor.replicas=2", 'actor.replica_addresses=["tcp://127.0.0.1:5", "tcp://127.0.0.1:5"]'],
            "actor.replica_addresses = ['tcp://127.0.0.1:5', 'tcp://127.0.0.1:5']: two replicas",
        ),
        (
            ['actor.replica_addresses=["udp://x:1"]'],
            'actor.replica_addresses[0] = "udp://x:1": expected tcp://HOST:PORT',
        ),
        (
            ["actor.replicas=2", "actor.connect=tcp://127.0.0.1:5555"],
            "actor.replicas = 2 with actor.connect set",
        ),
        (["actor.replicas=0"], "actor.replicas = 0: expected int >= 1"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, override)
    assert str(caught.value).startswith(message), str(caught.value)


def test_an_int_is_a_float_and_addresses_of_every_form_pass():
    cfg = load_config(
        None,
        [
            "envpool.temperature=1",
            "actor.address=tcp://[::1]:0",
            "learner.experience_address=ipc:///tmp/x.sock",
            "actor.connect=tcp://gpu-host-3:5555",
        ],
    )
    assert cfg.envpool.temperature == 1.0 and isinstance(cfg.envpool.temperature, float)


def test_env_args_overrides_merge_key_by_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[envpool]\nenv = "flaky"\nenv_args = { inner = "echo", crash_prob = 0.1 }\n')
    cfg = load_config(path, ["envpool.env_args.hang_prob=0.2", "envpool.env_args.crash_prob=0.0"])
    assert cfg.envpool.env_args == {"inner": "echo", "crash_prob": 0.0, "hang_prob": 0.2}


def test_bad_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_dump_round_trips():
    cfg = load_config(None, ['envpool.env_args={turns=3, prompt="hi"}', "train.steps=2"])
    again = msgspec.convert(tomllib.loads(dump_config(cfg)), Config)
    assert again == cfg


def test_every_field_is_documented():
    text = describe_config()
    for section in msgspec.structs.fields(Config):
        for field in msgspec.structs.fields(section.type):
            assert f"  {field.name} = " in text
    # No field without its doc line: each key line is followed by a non-empty description.
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.startswith("      "):
            assert lines[i + 1].strip(), f"{line.strip()} has no documentation"


def test_parse_overrides_rejects_value_as_section():
    with pytest.raises(ConfigError):
        parse_overrides(["a=1", "a.b=2"])


@pytest.mark.parametrize(
    "example", sorted((Path(__file__).parent.parent / "examples").glob("*.toml")), ids=str
)
def test_every_example_config_loads(example):
    """The configs docs/real-models.md and the README point users at stay valid."""
    load_config(example)


def test_a_list_or_table_the_shell_unquoted_says_how_to_quote_it():
    """Bash turns envpool.env_args={task="x"} into {task=x}, which is no TOML: the hint said to
    write values without quotes, the opposite of the fix."""
    for override in ("envpool.env_args={task=x}", "learner.lora_target_modules=[q_proj,k_proj]"):
        with pytest.raises(
            ConfigError, match="quote the strings in it, and the whole override for the shell"
        ):
            load_config(None, [override])

"""Config loading: overrides, strict errors that name the key, and the resolved dump."""

import tomllib

import msgspec
import pytest

from millstream.shared.config import Config, ConfigError, describe_config, dump_config, load_config, parse_overrides


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.steps=5", "envpool.env=bandit", "learner.lr=0.01",
                             "envpool.env_args={swap_names=true}", 'run.name="x y"'])
    assert cfg.train.steps == 5 and cfg.envpool.env == "bandit" and cfg.learner.lr == 0.01
    assert cfg.envpool.env_args == {"swap_names": True}
    assert cfg.run.name == "x y"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 7\ngroup_size = 4\n")
    cfg = load_config(path, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.group_size) == (9, 4)


@pytest.mark.parametrize("override, message", [
    (["train.stepz=3"], "unknown key 'train.stepz'"),
    (["nosuch.key=1"], "unknown key 'nosuch'"),
    (["train.group_size=1"], "train.group_size"),
    (["train.steps=many"], "train.steps"),
    (["learner.lr=-1"], "learner.lr"),
    (["train"], "expected dotted.key=value"),
    (["learner.advantage=ppo"], "expected one of 'grpo'"),
])
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, override)


def test_bad_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_dump_round_trips():
    cfg = load_config(None, ["envpool.env_args={turns=3, prompt=\"hi\"}", "train.steps=2"])
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

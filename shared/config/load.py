"""Loading the run configuration: one TOML file, dotted overrides, strict checks that name the key.

    cfg = load_config("run.toml", ["train.steps=5", "envpool.env=bandit"])

The sections and every key's documentation are in `shared/config/schema.py` (re-exported here).

Overrides are `dotted.key=value`; the value is read as a TOML value when it parses as one (`3`,
`0.5`, `true`, `"text"`, `[1, 2]`, `{a = 1}`) and as a plain string otherwise
(`envpool.env=bandit`). Overrides of a table merge into it key by key
(`envpool.env_args.size=6` keeps the file's other env_args).

Loading is strict, and every problem is one line that names the key, the value, what was
expected and, where a near miss exists, what was meant:

    train.steps = "8": expected int, got str
    actor.device = "tpu": expected one of 'auto', 'cpu', 'cuda'; did you mean 'cpu'?
    unknown key 'train.stepz'; did you mean 'train.steps'?

Types are not coerced (`steps = 8.0` is an error, not 8); an int is accepted where a float is
expected. Checks that span several keys (addresses, a generation budget that cannot fit the
context) run after the types (`check_config`), still before any role starts.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from datetime import date, time
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec

from millstream.shared.config.checks import check_config
from millstream.shared.config.limits import frame_limit
from millstream.shared.config.meta import ConfigError, show_value, toml_value
from millstream.shared.config.schema import (
    ActorConfig,
    ChaosConfig,
    Config,
    EnvPoolConfig,
    EvalConfig,
    LauncherConfig,
    LearnerConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    TransportConfig,
)

__all__ = [
    "Config",
    "RunConfig",
    "ModelConfig",
    "TrainConfig",
    "ActorConfig",
    "EnvPoolConfig",
    "LearnerConfig",
    "TransportConfig",
    "ChaosConfig",
    "LauncherConfig",
    "EvalConfig",
    "ConfigError",
    "load_config",
    "check_config",
    "parse_overrides",
    "dump_config",
    "toml_value",
    "describe_config",
    "config_keys",
    "DEFAULT_CONFIG",
]


#: The embedded default: the tiny model learning `evenchars`. `millstream run` with no file uses it.
DEFAULT_CONFIG = Config()

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "a.c=x"]` into the nested dict `{"a": {"b": 1, "c": "x"}}`."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"override {item!r} needs '=': write {key or 'key'}=VALUE")
        if not _KEY.fullmatch(key):
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node[leaf] = value
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`; tables merge key by key (env_args included), values replace, and an
    empty table (`envpool.env_args={}`) clears the one it replaces."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and value and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the embedded default when `path` is None), apply overrides, check."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a TOML file (not UTF-8 text)") from None
        except OSError as exc:  # a directory, no permission, ...
            raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    data = _merge(data, parse_overrides(overrides or []))
    try:
        cfg = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, data)) from None
    check_config(cfg)
    cfg.transport.max_frame_bytes = frame_limit(cfg)  # shared/config/limits.py
    return cfg


def _explain(exc: msgspec.ValidationError, data: dict[str, Any]) -> str:
    # msgspec says "Expected `int`, got `float` - at `$.train.steps`"; say it with our key names.
    match = re.search(r"^(.*?)(?: - at `\$\.?([^`]*)`)?$", str(exc), re.S)
    assert match is not None
    what, where = match.group(1), match.group(2) or ""
    unknown = re.match(r"Object contains unknown field `([^`]+)`", what)
    if unknown:
        key = ".".join(p for p in (where, unknown.group(1)) if p)
        return f"unknown key '{key}'{_did_you_mean(key, config_keys(sections=True))}"
    value = _lookup(data, where)
    shown = f"{where} = {show_value(value)}" if where else "<root>"
    choices = _choices(where)
    if choices:
        return (
            f"{shown}: expected one of {', '.join(map(repr, choices))}"
            f"{_did_you_mean(str(value), [str(c) for c in choices])}"
        )
    what = re.sub(r"`([^`]*)`", r"\1", what)
    what = what[0].lower() + what[1:] if what else what
    hint = ""
    if isinstance(value, str) and re.match(r"expected (object|array), got str", what):
        # The shell ate the quotes, or a bracket is missing: the override did not parse as TOML.
        hint = (
            " (a list or table in an override is TOML: quote the strings in it, and the whole "
            'override for the shell: \'key=["a", "b"]\', \'key={name="x"}\')'
        )
    elif isinstance(value, str) and what.startswith("expected") and "got str" in what:
        hint = " (write numbers and booleans without quotes)"
    elif isinstance(value, (int, float, bool, date, time)) and "expected str" in what:
        hint = " (quote text that TOML would read as another type: key='\"...\"')"
    return f"{shown}: {what}{hint}"


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    """The value at msgspec's path (`metrics.backends[1]`: keys and list indices), or None."""
    node: Any = data
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", dotted):
        if key:
            node = node.get(key) if isinstance(node, dict) else None
        else:
            node = node[int(index)] if isinstance(node, list) and int(index) < len(node) else None
    return node


def _did_you_mean(word: str, candidates: list[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def _field(dotted: str) -> msgspec.structs.FieldInfo | None:
    parts = dotted.split(".")
    if len(parts) != 2:
        return None
    section = next((f for f in msgspec.structs.fields(Config) if f.name == parts[0]), None)
    if section is None:
        return None
    return next((f for f in msgspec.structs.fields(section.type) if f.name == parts[1]), None)


def _choices(dotted: str) -> tuple[Any, ...]:
    """The allowed values of a Literal-typed key or list element (`metrics.backends[1]`), or ()."""
    element = re.fullmatch(r"(.*)\[\d+\]", dotted)
    field = _field(element.group(1) if element else dotted)
    if field is None:
        return ()
    tp = get_args(field.type)[0] if hasattr(field.type, "__metadata__") else field.type
    if element:
        tp = get_args(tp)[0] if get_origin(tp) is list else None
    return get_args(tp) if get_origin(tp) is Literal else ()


def config_keys(*, sections: bool = False) -> list[str]:
    """Every dotted key (`train.steps`, ...), and with `sections` the section names too."""
    keys = [f.name for f in msgspec.structs.fields(Config)] if sections else []
    for section in msgspec.structs.fields(Config):
        keys += [f"{section.name}.{f.name}" for f in msgspec.structs.fields(section.type)]
    return keys


# --- checks across keys ------------------------------------------------------------------------


def dump_config(cfg: Config) -> str:
    """The config as TOML (every field, defaults included): the run's resolved config."""
    lines: list[str] = []
    for section, value in msgspec.structs.asdict(cfg).items():
        lines.append(f"[{section}]")
        for key, item in msgspec.structs.asdict(value).items():
            lines.append(f"{key} = {toml_value(item)}")
        lines.append("")
    return "\n".join(lines)


def describe_config() -> str:
    """Every key with its default and documentation, for `millstream config`."""
    out: list[str] = []
    for section in msgspec.structs.fields(Config):
        out.append(f"[{section.name}]")
        for f in msgspec.structs.fields(section.type):
            meta = getattr(f.type, "__metadata__", ())
            doc = next((m.description for m in meta if isinstance(m, msgspec.Meta)), "")
            default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            out.append(f"  {f.name} = {toml_value(default)}")
            out.append(f"      {doc}")
    return "\n".join(out)

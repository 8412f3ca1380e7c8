"""Chat templates as transformers renders them, and the model files they come from.

Rendering follows transformers (transformers/utils/chat_template_utils.py): a sandboxed jinja
environment with `trim_blocks`/`lstrip_blocks`, loop controls, its `tojson` (no HTML escaping),
`raise_exception`, `strftime_now` and `{% generation %}`; the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) passed to the template; templates looked up in transformers'
order (`chat_template.jinja` and `additional_chat_templates/*.jinja` beside the tokenizer, else
`tokenizer_config.json`'s `chat_template`, a string or a list of named templates; `tool_use` is
picked when tools are given); the rendered text encoded without adding special tokens. A
template that refuses a conversation (`raise_exception`) raises `ChatTemplateError` naming the
template and its message.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from millstream.shared.config import Config

__all__ = ["ChatTemplateError", "compile_template", "load_chat_templates", "special_tokens", "tokenizer_dir"]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# What transformers' tokenizer classes of the main families use for a token that
# tokenizer_config.json leaves out (their __init__ defaults).
_CLASS_DEFAULTS = {
    "Qwen2Tokenizer": {
        "unk_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    },
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "GemmaTokenizer": {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
}


class ChatTemplateError(ValueError):
    """The model's chat template refused a conversation (`raise_exception`) or failed on it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' own filter: jinja's escapes HTML characters, which would change the text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant masks): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own attribute, typed as a set)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


def load_chat_templates(path: str | Path) -> tuple[dict[str, str], str]:
    """The model's chat templates by name, and where they came from, in transformers' order.

    Template files beside the tokenizer (`chat_template.jinja` is "default",
    `additional_chat_templates/NAME.jinja` is NAME) replace tokenizer_config.json's entry.
    """
    path = Path(path)
    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates, str(path / "chat_template.jinja" if "default" in templates else extra)
    config_file = path / "tokenizer_config.json"
    entry = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(entry, str) and entry:
        return {"default": entry}, str(config_file)
    if isinstance(entry, list) and entry:
        return {t["name"]: t["template"] for t in entry}, str(config_file)
    raise ValueError(f"{path} has no chat template (no chat_template.jinja, none in tokenizer_config.json)")


def special_tokens(path: Path, config: dict) -> dict[str, str]:
    """The named special tokens transformers passes to the template (its `special_tokens_map`)."""
    values = dict(_CLASS_DEFAULTS.get(str(config.get("tokenizer_class", "")).removesuffix("Fast"), {}))
    values.update({k: config[k] for k in SPECIAL_TOKEN_NAMES if k in config})
    legacy = path / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():  # transformers' legacy branch
        values.update({k: v for k, v in json.loads(legacy.read_text()).items() if k in SPECIAL_TOKEN_NAMES})
    out = {}
    for name, value in values.items():
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None:
            out[name] = str(value)
    return out


def compile_template(text: str) -> jinja2.Template:
    """A template's source compiled in transformers' environment (jinja's errors pass through)."""
    return _ENV.from_string(text)


def tokenizer_dir(cfg: Config) -> str:
    """The model directory whose tokenizer and chat template the envpool uses.

    The envpool never builds the tiny model (that needs torch); the launcher or actor does.
    """
    path = Path(cfg.model.path or cfg.model.tiny_dir).expanduser()
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"no tokenizer.json in {path}: set model.path (the launcher does) or build the tiny "
            "model first with `millstream tiny-model DIR`"
        )
    return str(path)

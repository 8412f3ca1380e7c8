"""Tests of shared.models.tiny: the tiny random Qwen2 chat model built on local disk.

vLLM is not started here (the real-engine fixtures do that); these tests load the
model with transformers only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from millstream.shared.models.tiny import MARKER, MODEL_FILES, SPECIAL_TOKENS, build_tiny_model, main  # noqa: E402

PROMPTS = ["Hello there, how are you?", "What is 12 + 7?", "Tell me a story about the sea."]


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _chat_ids(tok, content: str) -> list[int]:
    out = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    # transformers 5 returns a BatchEncoding here, 4.x a plain list.
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m0", seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_directory_layout(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert names == set(MODEL_FILES) | {MARKER}  # no leftover temp folder
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    assert set(SPECIAL_TOKENS) <= set(ids)
    assert cfg["eos_token_id"] == ids["<|im_end|>"]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ids["<|im_end|>"]


def test_build_is_deterministic(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _hashes(again) == _hashes(model_dir)


def test_seed_changes_weights_and_tokenizer(model_dir, tmp_path):
    from safetensors.torch import load_file

    other = build_tiny_model(tmp_path / "seed1", seed=1)
    a, b = load_file(model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"]
    )
    assert (model_dir / "tokenizer.json").read_bytes() != (other / "tokenizer.json").read_bytes()


def test_rebuild_is_skipped_when_arguments_match(model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert build_tiny_model(model_dir, seed=0) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert json.loads((model_dir / MARKER).read_text())["seed"] == 0


def test_rebuild_happens_when_arguments_change(tmp_path):
    d = build_tiny_model(tmp_path / "m", seed=0, hidden_size=64, num_layers=1)
    weights = (d / "model.safetensors").read_bytes()
    build_tiny_model(d, seed=5, hidden_size=64, num_layers=1)
    assert json.loads((d / MARKER).read_text())["seed"] == 5
    assert (d / "model.safetensors").read_bytes() != weights
    # A half-written directory (marker present, a file missing) is rebuilt too.
    (d / "tokenizer.json").unlink()
    build_tiny_model(d, seed=5, hidden_size=64, num_layers=1)
    assert (d / "tokenizer.json").is_file()


def test_cli_and_sizes(tmp_path, capsys):
    out = main(
        [str(tmp_path / "cli"), "--seed", "3", "--vocab-size", "384", "--hidden-size", "64", "--layers", "1"]
    )
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (384, 64, 1)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == 384
    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert m.get_input_embeddings().weight.shape == (384, 64)


def test_bfloat16_weights(tmp_path):
    from safetensors.torch import load_file

    d = build_tiny_model(tmp_path / "bf16", hidden_size=64, num_layers=1, dtype="bfloat16")
    assert {t.dtype for t in load_file(d / "model.safetensors").values()} == {torch.bfloat16}
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "bad", dtype="int8")


def test_tokenizer_vocab_and_special_tokens(tok, model):
    assert len(tok) == 512 == model.config.vocab_size
    assert model.get_output_embeddings().weight.shape[0] == 512
    for s in SPECIAL_TOKENS:
        assert tok.encode(s, add_special_tokens=False) == [tok.convert_tokens_to_ids(s)]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == model.config.eos_token_id


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The answer is 42.",
        "  two  spaces,\ttabs\nand new lines\n\n",
        'JSON: {"ok": true, "n": [1, 2.5]}',
        "Unicode: café, naïve, 日本語, emoji 🙂",
    ],
)
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # The raw tokenizers library agrees with transformers on the ids.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(Path(tok.name_or_path) / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids


def test_chat_template_layout(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = _chat_ids(tok, "Hi")
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_generation_is_not_degenerate(tok, model):
    outs = []
    for p in PROMPTS:
        ids = _chat_ids(tok, p)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id
            )
        new = out[0, len(ids) :].tolist()
        assert len(new) >= 8
        assert len(set(new)) >= len(new) // 2, new  # not one token (or two) over and over
        outs.append(new)
    assert len({tuple(o) for o in outs}) == len(outs), outs  # different prompts, different replies

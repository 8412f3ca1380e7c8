"""
Build a tiny random-weight chat model on local disk, so tests and benchmarks
can run the whole actor/learner loop without downloading anything.

The model is a small Qwen2ForCausalLM (two layers, hidden size 128 by default)
with random weights, plus a byte-level BPE tokenizer trained right here on a
synthetic corpus that is generated from the seed. It knows nothing, but it is
a real Hugging Face model directory: transformers and vLLM both load it, the
chat template is Qwen-style ChatML, and greedy decoding gives varied output
rather than one token over and over.

Everything is a pure function of the arguments: the same arguments give the
same bytes in every file, and a directory that already holds a model built with
the same arguments is reused as is (see millstream_tiny.json inside it).

Launch it with:

    python -m millstream.shared.models.tiny /tmp/tiny --seed 0

or from Python:

    from millstream.shared.models.tiny import build_tiny_model
    model_dir = build_tiny_model("/tmp/tiny", seed=0)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
from pathlib import Path

__all__ = ["build_tiny_model", "main", "MARKER", "MODEL_FILES", "SPECIAL_TOKENS"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER = "millstream_tiny.json"
# Bump when the recipe changes, so old directories are rebuilt instead of reused.
RECIPE_VERSION = 1
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON_WORDS = (
    "the of and to a in is it you that he was for on are with as his they be at one have this "
    "from or had by not word but what some we can out other were all there when up use your how "
    "said each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round year came show every good me "
    "give our under name very through just form sentence great think say help line turn much mean "
    "before move right old same tell does set three want well also play small end put home read "
    "hand large add even here must big high such follow why ask change went light kind need house "
    "try again point world near build earth head stand page should found answer school grow study "
    "still learn food sun four between keep never last let thought city tree start might story "
    "far sea draw left late run while close night real life open seem together next"
).split()

_CHAT_OPENERS = [
    "Hello, how are you?",
    "Can you help me with this?",
    "What is the answer?",
    "Please explain step by step.",
    "Thanks!",
    "Sure, here is the answer:",
    "Let me think about it.",
    "The answer is",
    "You are a helpful assistant.",
    "I don't know.",
    "Good question!",
    "Here's what I found:",
]


def _synthetic_corpus(seed: int, vocab_size: int) -> list[str]:
    """English-like prose, arithmetic and chat-like lines, all drawn from `seed`."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    # Made-up words give the BPE merges something besides the fixed word list,
    # so different seeds really give different tokenizers; bigger vocabularies
    # need more distinct words to have enough merges to learn.
    made_up = [
        "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
        for _ in range(max(200, vocab_size))
    ]
    words = _COMMON_WORDS + made_up

    def sentence() -> str:
        out = []
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.08:
                out.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
            elif r < 0.12 and out:
                out[-1] += ","
            else:
                out.append(rng.choice(words))
        out[0] = out[0].capitalize()
        return " ".join(out) + rng.choice("..........?!:;")

    lines = []
    for _ in range(max(3000, 2 * vocab_size)):
        kind = rng.random()
        if kind < 0.5:
            lines.append(" ".join(sentence() for _ in range(rng.randint(1, 3))))
        elif kind < 0.65:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            val = {"+": a + b, "-": a - b, "*": a * b}[op]
            lines.append(f"What is {a} {op} {b}? The answer is {val}.")
        elif kind < 0.9:
            role = rng.choice(["user", "assistant", "system"])
            lines.append(f"{role}\n{rng.choice(_CHAT_OPENERS)} {sentence()}")
        else:
            key = rng.choice(words)
            lines.append(f'{{"{key}": {rng.randint(0, 99)}, "ok": true}} (see "{key}")')
    return lines


def _train_tokenizer(seed: int, vocab_size: int):
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer as Qwen2. transformers picks its
    # Qwen2Tokenizer class from model_type and rebuilds these pieces itself, so
    # anything else here would make raw `tokenizers`, transformers and vLLM
    # disagree on token ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(seed, vocab_size), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer came out with {tok.get_vocab_size()} tokens, "
            f"wanted {vocab_size}; the synthetic corpus is too small"
        )
    return tok


def _quiet_token_ids(tok) -> list[int]:
    """Tokens that decode to broken UTF-8 or control characters, plus the
    specials a reply should not contain (<|im_end|> stays, so replies can end)."""
    quiet = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i)
        if piece in ("<|endoftext|>", "<|im_start|>"):
            quiet.append(i)
        elif piece not in SPECIAL_TOKENS:
            text = tok.decode([i])
            if "\ufffd" in text or not all(c.isprintable() or c in "\n\t" for c in text):
                quiet.append(i)
    return quiet


def _init_weights(seed: int, cfg: dict, quiet_ids: list[int]) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def randn(*shape, std):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    # Plain std 0.02 everywhere gives logits with std ~0.2 and top-two margins
    # ~0.03: greedy decoding falls into runs like "answer answer answer", and
    # margins that thin could let vLLM's and transformers' kernels pick
    # different tokens. Unit embeddings keep the current token visible, larger
    # q/k make attention prefer some positions over others, and a wide lm_head
    # spreads the logits (std ~3.5) so the argmax is clear.
    std_in = 1.0 / math.sqrt(h)
    w = {"model.embed_tokens.weight": randn(v, h, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = randn(q_out, h, std=2.0 * std_in)
        w[p + "self_attn.q_proj.bias"] = randn(q_out, std=0.02)
        w[p + "self_attn.k_proj.weight"] = randn(kv_out, h, std=2.0 * std_in)
        w[p + "self_attn.k_proj.bias"] = randn(kv_out, std=0.02)
        w[p + "self_attn.v_proj.weight"] = randn(kv_out, h, std=std_in)
        w[p + "self_attn.v_proj.bias"] = randn(kv_out, std=0.02)
        w[p + "self_attn.o_proj.weight"] = randn(h, q_out, std=1.0 / math.sqrt(q_out))
        w[p + "mlp.gate_proj.weight"] = randn(inter, h, std=std_in)
        w[p + "mlp.up_proj.weight"] = randn(inter, h, std=std_in)
        w[p + "mlp.down_proj.weight"] = randn(h, inter, std=1.0 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = randn(v, h, std=4.0 * std_in)
    # Shrunk rows rarely win, so decoded text is mostly valid UTF-8 and
    # vLLM's incremental detokenizer gives the same string as tokenizer.decode.
    w["lm_head.weight"][quiet_ids] *= 0.1
    return w


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
    tied: bool = False,
) -> Path:
    """Write a tiny random Qwen2 chat model into `out_dir` and return its path.

    `tied` ties the output head to the embeddings (`tie_word_embeddings`), as most small real
    models do; the default model is untied (see `_write_model`), and a tied one exists to test
    what ties change (the engine's weight reload, for one).
    """
    out = Path(out_dir)
    args = dict(
        recipe=RECIPE_VERSION,
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        tied=tied,
    )
    marker = out / MARKER
    try:
        if json.loads(marker.read_text()) == args and all((out / f).is_file() for f in MODEL_FILES):
            return out
    except (OSError, ValueError):
        pass

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("num_heads must divide hidden_size and num_kv_heads must divide num_heads")
    if not 260 <= vocab_size <= 8192:
        raise ValueError("vocab_size must be in [260, 8192]: 256 bytes, 3 specials, some merges")

    out.mkdir(parents=True, exist_ok=True)
    # Drop the marker first so a build that dies halfway is never taken as complete.
    marker.unlink(missing_ok=True)
    # Files are written into a private folder and then renamed into place, so two
    # processes building the same directory at once each move whole files.
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        _write_model(Path(tmp), args)
        for name in MODEL_FILES + (MARKER,):  # the marker goes last
            os.replace(Path(tmp) / name, out / name)
    return out


def _write_model(out: Path, args: dict) -> None:
    seed, vocab_size, dtype = args["seed"], args["vocab_size"], args["dtype"]
    tok = _train_tokenizer(seed, vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    tok.save(str(out / "tokenizer.json"))

    n_layers = args["num_layers"]
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["intermediate_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": args["num_heads"],
        "num_key_value_heads": args["num_kv_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "max_position_embeddings": args["max_position_embeddings"],
        # Both spellings of the RoPE base: transformers 5 reads rope_parameters, 4.x rope_theta.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n_layers,
        "layer_types": ["full_attention"] * n_layers,
        # Random init with tied embeddings makes every output echo the last token: the default
        # model is untied, and `tied` exists for the tests of what ties change.
        "tie_word_embeddings": args["tied"],
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "pad_token_id": eot,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json", {"bos_token_id": eot, "eos_token_id": im_end, "pad_token_id": eot}
    )

    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "chat_template": CHAT_TEMPLATE,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            # No space clean-up, so decode(encode(text)) gives back text exactly.
            "clean_up_tokenization_spaces": False,
            "add_prefix_space": False,
            "split_special_tokens": False,
            "padding_side": "left",
            "model_max_length": args["max_position_embeddings"],
        },
    )

    import torch
    from safetensors.torch import save_file

    weights = _init_weights(seed, cfg, _quiet_token_ids(tok))
    if args["tied"]:
        # The head is the embedding matrix: scaled as the untied head is, or the logits (std ~11
        # with unit embeddings) would put all the probability on one token.
        head = weights.pop("lm_head.weight")
        weights["model.embed_tokens.weight"] *= head.std() / weights["model.embed_tokens.weight"].std()
    weights = {k: t.to(getattr(torch, dtype)).contiguous() for k, t in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors makes it owner-only
    _write_json(out / MARKER, args)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(
        prog="python -m millstream.shared.models.tiny", description="Build a tiny random Qwen2 chat model."
    )
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args(argv)
    path = build_tiny_model(
        a.out_dir, a.seed, vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.layers
    )
    print(path)
    return path


if __name__ == "__main__":
    main()

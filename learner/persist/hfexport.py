"""Write the policy as a Hugging Face model directory that transformers and vLLM load.

The learner trains with `use_cache=False` and, with DeepSpeed bf16, keeps fp32 master weights;
the directory it writes says what inference wants (`use_cache=True`) and the dtype the weights
really have, and carries the tokenizer files of the model it started from.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_model_dir", "TOKENIZER_FILES"]

# Tokenizer files copied next to the saved weights (the rest of the model dir is weights/config).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def save_model_dir(module: Any, weights: dict[str, torch.Tensor], source_dir: Path, out: Path) -> None:
    """`module`'s config and generation config, `weights` as model.safetensors, and the
    tokenizer files of `source_dir`, into `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = module.config
    saved = (config.use_cache, config.dtype)
    # Inference wants its KV cache back; and say the dtype the weights really have (bf16 runs).
    config.use_cache, config.dtype = True, next(iter(weights.values())).dtype
    try:
        config.save_pretrained(out)
    finally:
        config.use_cache, config.dtype = saved
    if module.generation_config is not None:
        module.generation_config.save_pretrained(out)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out / name)

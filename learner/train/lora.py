"""LoRA training (`learner.lora_rank > 0`): peft adapters on the learner, merged weights for the actor.

The learner wraps its model with peft's LoRA (`wrap`): the base weights are frozen and only the
adapter matrices A and B of each targeted linear layer train, so the optimizer (and its state)
sees only those. Everything downstream of the trainer keeps seeing a plain model:

- The actor receives MERGED weights through the usual flat broadcast (`merged_weights`): for each
  targeted linear, `W + scaling * B @ A` under the base parameter name vLLM expects; every other
  tensor as it is. The merge is computed into new tensors, never into the trained module (peft's
  `merge_adapter` would modify the base weight in place and must be undone exactly, which float
  arithmetic does not promise). All tensors are sent, not only the targeted ones: the flat
  layout and the actor's loading stay exactly those of full training. Measured on the tiny model
  (rank 8, all projections): `merged_weights` takes 1.3 ms (best of 100, CPU), next to 0.1-0.9 s
  for a whole push (`sync/total_s`); on a real model each targeted layer adds one rank-r matmul
  (2 r d_out d_in flops: ~0.3 GFLOP for 4096 x 4096 at rank 8).
  Why merged rather than vLLM's own LoRA adapters: the actor then needs no LoRA support at all
  (whether vLLM's CPU backend serves LoRA, and at what cost, was not measured here), a LoRA
  forward would add adapter matmuls to every decode step of every targeted layer, the prefix
  cache and the weight digest work as for full training, and there is one broadcast path. The
  price is sending the whole model per update instead of the adapters (a few MB).
- Checkpoints hold the adapter in peft's format (`save_adapter`: adapter_config.json and
  adapter_model.safetensors, under `adapter/`), beside DeepSpeed's state (which holds the whole
  peft module, so resume restores adapters and their optimizer state) and the `hf/` directory,
  which holds merged full weights so transformers and vLLM load the result without peft.

`check_targets` says which configured target modules match no module of the model, from the
model's config alone (an empty model on the meta device), before any weights load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from millstream.shared.config import LearnerConfig

__all__ = ["check_targets", "wrap", "merged_weights", "save_adapter", "base_name", "ADAPTER_DIR"]

#: A checkpoint's sub-folder for the peft adapter.
ADAPTER_DIR = "adapter"
_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # an optional extra
        raise ImportError(
            "learner.lora_rank > 0 needs peft: install millstream with the `lora` extra "
            "(pip install -e '.[lora]')"
        ) from exc
    return peft


def unmatched_targets(module_names: list[str], targets: list[str]) -> list[str]:
    """The entries of `targets` that name no module: peft matches a target against the last
    name component (or the dotted tail) of each module's name."""
    return [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in module_names)]


def check_targets(model_dir: str | Path, targets: list[str]) -> None:
    """Raise ValueError naming `learner.lora_target_modules` entries that match no linear layer
    of the model at `model_dir`; reads only its config (no weights are loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):  # shapes only, no memory and no weights
        model = AutoModelForCausalLM.from_config(config)
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if missing := unmatched_targets(linears, targets):
        tails = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(
            f"learner.lora_target_modules: {missing} match no linear layer of the model at "
            f"{model_dir} (its linear layers are named {tails})"
        )


def wrap(model: torch.nn.Module, cfg: LearnerConfig) -> torch.nn.Module:
    """`model` as a peft LoRA model: base weights frozen, adapters (B = 0: no change yet) trainable."""
    peft = _import_peft()
    config = peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def base_name(peft_name: str) -> str:
    """The base model's name for a peft parameter name (what vLLM and transformers expect)."""
    name = peft_name.removeprefix(_PREFIX)
    return name.replace(".base_layer.", ".")


def merged_weights(
    peft_model: torch.nn.Module,
    gathered: Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base parameter, with LoRA merged into the targeted ones, as detached CPU copies
    under the base model's names, in module order. The module is not modified.

    `gathered(params)` makes sharded parameters whole for the duration (ZeRO-3); collective
    there, so every rank must run this to the end."""
    from peft.tuners.lora import LoraLayer

    gather = gathered or (lambda _params: nullcontext())
    layers = {name: m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    for name, param in peft_model.named_parameters():
        if ".lora_" in name:
            continue  # the adapters themselves: merged below into their base weight
        layer_name, _, leaf = name.rpartition(".base_layer.")
        layer: Any = layers.get(layer_name) if leaf == "weight" else None  # peft's lora.Linear
        if layer is None:
            with gather([param]):
                yield base_name(name), param.detach().to("cpu", copy=True)
            continue
        adapters = [p for key in layer.active_adapters for p in _adapter_params(layer, key)]
        with gather([param, *adapters]), torch.no_grad():
            merged = param.detach().to("cpu", dtype=torch.float32, copy=True)
            for key in layer.active_adapters:
                merged += layer.get_delta_weight(key).detach().to("cpu", dtype=torch.float32)
            yield base_name(name), merged.to(param.dtype)


def _adapter_params(layer: Any, key: str) -> list[torch.nn.Parameter]:
    return [layer.lora_A[key].weight, layer.lora_B[key].weight]


def save_adapter(
    peft_model: Any,
    out: Path,
    gathered: Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]] | None = None,
    *,
    write: bool = True,
) -> None:
    """Write the adapter in peft's format (adapter_config.json, adapter_model.safetensors) to
    `out`; loads with `peft.PeftModel.from_pretrained(base_model, out)`. Collective under
    ZeRO-3 (`gathered`); only callers with `write` write."""
    adapters = [p for n, p in peft_model.named_parameters() if ".lora_" in n]
    with (gathered or (lambda _params: nullcontext()))(adapters):
        state = {
            n: p.detach().to("cpu", copy=True) for n, p in peft_model.named_parameters() if ".lora_" in n
        }
        if write:  # peft keeps only the adapter's entries and drops the adapter name itself
            peft_model.save_pretrained(str(out), state_dict=state)

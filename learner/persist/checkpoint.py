"""Resumable learner checkpoints: the policy, its optimizer, the replay buffer and the RNGs.

Layout, under the run directory:

    checkpoints/
        latest                  text file: the name of the newest complete checkpoint
        step_000012/            one checkpoint per saved policy version (the engine's step)
            deepspeed/          engine.save_checkpoint: weights, optimizer, global step (per rank)
            hf/                 the POLICY weights as a Hugging Face directory (safetensors,
                                config, tokenizer): what vLLM or transformers load (with
                                LoRA: the adapters merged into full weights)
            adapter/            LoRA runs only: the adapter in peft's format (adapter_config.json,
                                adapter_model.safetensors), for PeftModel.from_pretrained
            learner_state.msgpack   version, replay buffer (learner/persist/replaystate.py),
                                    the caller's `extra`, RNG states
            rng_rank_1.msgpack  RNG states of ranks other than 0 (multi-rank runs only)
            zero_to_fp32.py ... DeepSpeed's own recovery scripts (it copies them in)

Atomicity: everything is written into `checkpoints/.tmp-step_000012`, each file is flushed to
disk, and only then is the folder renamed to `step_000012` (a rename within one file system is
atomic), after which `latest` is replaced the same way (write `latest.tmp`, rename). A crash
leaves either the old checkpoint set or the new one, plus at worst a `.tmp-*` folder that the
next save removes: a `step_*` folder is always whole. Pruning runs last and removes only older
checkpoints, so `latest` never names a deleted one.

A save that fails (a full disk, most often: DeepSpeed's torch.save reports it as a RuntimeError,
our own writes as OSError) removes what it wrote (its `.tmp-*` folder, or the renamed folder if
`latest` could not be pointed at it), which gives the space back, and raises `CheckpointFailed`
naming the step, the cause and the space left; `latest` still names the last complete
checkpoint. With one learner rank the loop carries on training after a disk's failure and tries
again at the next interval (learner/loop/saving.py); with several, a rank that failed cannot
leave the others' collectives, so the error ends the learner as before, and a restart resumes
from `latest`.

Resuming restores the policy, not the initial weights (slime's resume pushed the reference
model): the engine's weights, optimizer state and global step come back from DeepSpeed, and
`load_checkpoint` checks that `trainer.version` equals the saved version before returning.

Multi-rank (torchrun): every rank calls `save_checkpoint` and `load_checkpoint` (DeepSpeed and
ZeRO-3 gathering are collective); rank 0 writes everything but the engine shards and the other
ranks' RNG files, and only rank 0 needs a buffer (other ranks may pass None).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from millstream.learner.persist.replaystate import buffer_state, load_buffer_state
from millstream.shared.store.rundir import STATE_FILE, find_checkpoint, step_dirs

__all__ = ["CheckpointFailed", "save_checkpoint", "find_checkpoint", "load_checkpoint", "STATE_FILE"]

log = logging.getLogger("learner.checkpoint")

_ENGINE_TAG = "deepspeed"  # DeepSpeed's sub-folder (its "tag") inside a checkpoint
_FORMAT = 1
_RESERVED = ("version", "restored_groups")  # keys load_checkpoint adds to the returned dict


class CheckpointFailed(RuntimeError):
    """A checkpoint was not saved; its partial folder is gone and `latest` is unchanged."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _ranks() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, np.asarray(key, dtype=np.uint32).tobytes(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": (
            [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
        ),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.frombuffer(key, dtype=np.uint32).copy(), pos, has_gauss, gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
            )
        else:
            log.warning(
                "CUDA RNG states not restored: saved for %d devices, %d visible",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under `root` (DeepSpeed and safetensors do not)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, trainer, buffer, extra: dict, keep: int) -> Path:
    """Saves a resumable checkpoint of the trainer's current version; returns its folder.

    `extra`: the caller's own resumable state (msgspec-encodable: plain numbers, strings, lists,
    dicts), returned by `load_checkpoint`. Keeps the `keep` newest checkpoints up to this one;
    higher-numbered ones (left by a run that was resumed from an older step) are not touched.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if clash := [k for k in _RESERVED if k in extra]:
        raise ValueError(f"extra may not use the reserved keys {clash}")
    rank, version = _rank(), trainer.version
    root = Path(run_dir) / "checkpoints"
    name = f"step_{version:06d}"
    final, tmp = root / name, root / f".tmp-{name}"
    # Encode first: an unencodable `extra` must fail before anything is written.
    state = msgspec.msgpack.encode(
        {
            "format": _FORMAT,
            "version": version,
            "extra": extra,
            "rng": _rng_state(),
            "buffer": buffer_state(buffer) if rank == 0 else None,
        }
    )
    try:
        _write(root, tmp, trainer, rank, state)
    except Exception as exc:
        if _ranks() > 1:
            raise  # the other ranks are in the save's collectives: the learner ends (see above)
        free = shutil.disk_usage(root).free / 2**20 if root.exists() else float("nan")  # as it failed
        shutil.rmtree(tmp, ignore_errors=True)  # its space back; `latest` was not touched
        raise CheckpointFailed(
            f"checkpoint {name} not saved: {type(exc).__name__}: {exc} ({free:.0f} MiB free in {root})"
        ) from exc
    if rank == 0:
        try:
            _publish(root, final, tmp, name)
        except OSError as exc:
            if _ranks() > 1:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            if _latest_name(root) != name:  # whole but unnamed: its space back, `latest` as it was
                shutil.rmtree(final, ignore_errors=True)
            raise CheckpointFailed(f"checkpoint {name} not published: {exc}") from exc
        try:
            _prune(root, version, keep)
        except OSError as exc:  # the checkpoint is saved and named: older ones stay a while
            log.warning("pruning older checkpoints in %s failed: %s", root, exc)
        log.info("checkpoint %s saved", final)
    _barrier()
    return final


def _write(root: Path, tmp: Path, trainer, rank: int, state: bytes) -> None:
    """Everything of one checkpoint into `tmp`, on disk (every rank)."""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
        tmp.mkdir()
    _barrier()
    trainer.engine.save_checkpoint(str(tmp), tag=_ENGINE_TAG, save_latest=False)
    trainer.save_pretrained(str(tmp / "hf"))
    if getattr(trainer, "lora", False):  # the adapter in peft's format too (learner/train/lora.py)
        trainer.save_adapter(str(tmp / "adapter"))
    if rank == 0:
        _write_synced(tmp / STATE_FILE, state)
    else:
        _write_synced(tmp / f"rng_rank_{rank}.msgpack", msgspec.msgpack.encode(_rng_state()))
    _barrier()
    if rank == 0:
        _fsync_tree(tmp)


def _latest_name(root: Path) -> str:
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return ""


def _publish(root: Path, final: Path, tmp: Path, name: str) -> None:
    """Rename the written checkpoint into place, then point `latest` at it (rank 0)."""
    if final.exists():  # saving the same version again (e.g. at the end of a resumed run)
        old = root / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _write_synced(root / "latest.tmp", f"{name}\n".encode())
    os.replace(root / "latest.tmp", root / "latest")
    _fsync_dir(root)


def _prune(root: Path, version: int, keep: int) -> None:
    ours = [p for v, p in step_dirs(root) if v <= version]
    for path in ours[:-keep]:
        shutil.rmtree(path)
    for path in root.glob(".tmp-*"):  # abandoned by crashed saves of other steps
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".old-*"):
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path, trainer, buffer) -> dict:
    """Restores the engine (weights, optimizer, step), the buffer and the RNG states from the
    checkpoint folder `path` (see `find_checkpoint`). Returns the saved `extra` dict plus
    "version" (the restored policy version) and "restored_groups" (complete groups back in the
    buffer; partial ones come back too). Call on every rank, before
    anything uses the weights; `buffer` may be None on ranks other than 0."""
    path, rank = Path(path), _rank()
    state = msgspec.msgpack.decode((path / STATE_FILE).read_bytes())
    if state.get("format") != _FORMAT:
        raise ValueError(
            f"{path / STATE_FILE} has format {state.get('format')!r}, this code reads format {_FORMAT}"
        )
    loaded, _ = trainer.engine.load_checkpoint(
        str(path), tag=_ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise FileNotFoundError(f"DeepSpeed found no engine checkpoint in {path / _ENGINE_TAG}")
    if trainer.version != state["version"]:
        raise RuntimeError(
            f"{path}: engine restored at step {trainer.version}, the checkpoint "
            f"was saved at version {state['version']}"
        )
    restored = 0
    if buffer is not None:
        if state["buffer"] is None:
            raise ValueError(f"{path} holds no replay buffer (saved by a rank other than 0?)")
        restored = load_buffer_state(buffer, state["buffer"])
    rng = state["rng"]
    if rank != 0:
        own = path / f"rng_rank_{rank}.msgpack"
        rng = msgspec.msgpack.decode(own.read_bytes()) if own.is_file() else None
        if rng is None:
            log.warning("no RNG state for rank %d in %s; keeping the current one", rank, path)
    if rng is not None:
        _set_rng_state(rng)
    log.info("resumed from %s at version %d (%d complete groups restored)", path, state["version"], restored)
    return {**state["extra"], "version": state["version"], "restored_groups": restored}

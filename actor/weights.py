"""The vLLM worker extension that receives the learner's weights.

vLLM mixes this class into each of its worker processes (`worker_extension_cls`), and the actor
server calls its methods through `AsyncLLM.collective_rpc`. The weights themselves never pass
through that RPC (it pickles its arguments; a model's worth of tensors would be copied several
times): the worker joins a torch.distributed group with the learner and receives the broadcast
of a flat buffer, which it cuts into named views and hands to vLLM's `reload_weights`.

An update is three calls, so that generation stops only for the last:

    millstream_receive(...)  start receiving into the worker's kept buffer, in a thread
                             (actor/receive.py); the engine goes on generating
    millstream_received()    polled by the actor until every piece is in
    millstream_load(...)     with generation paused: load the buffer, repack tied layers

On NCCL the receive itself happens in `millstream_load`, inside the pause (actor/receive.py says
why), so the three calls are the same on every backend.

Which backend: the learner decides (`pick_backend`), from the GPU each worker reports
(`millstream_device`, in the actor's `ActorInfo`): NCCL only when no two members of the group
share a GPU. On gloo the worker receives into host memory even on a GPU, and the load copies each
tensor to the device.

The learner lays the update out as one flat buffer (learner/sync/layout.py says how it is cut into
pieces) and describes the layout once per update in the `WeightUpdate` message; the worker
receives into its own flat buffer of that layout and hands views of it to `reload_weights`.

How the group is formed (stateless, its own TCPStore, rebuilt per learner session) is in
`shared/wire/weightsync.py`, which the learner uses too.

Tensor parallelism (`actor.tensor_parallel_size` > 1): vLLM runs one worker per TP rank, each
holding a shard of every split layer. Each worker joins the group (rank 1 + its vLLM rank, so
the group has 1 + TP members) and receives the *whole* flat buffer; `reload_weights` runs the
model's own `load_weights`, whose per-layer loaders cut out this worker's shard (the same path
that loads a checkpoint). The learner therefore sends the same unsharded tensors whatever the
TP size, and needs no knowledge of how vLLM splits a model. The cost: every worker keeps a full
copy of the weights next to its shard, from its first update on (over NCCL: model-size memory
per GPU beyond `gpu_memory_utilization`'s share; over gloo, host memory, a copy per worker; the
receive buffer is kept so that the next update can arrive while the engine generates), and the
broadcast has TP receivers, not one.

Nothing here imports the actor server: this module must be importable alone in vLLM's spawned
worker processes.

vLLM's layer-wise reload logs "RotaryEmbedding: Failed to load weights" at every update. It is
not a failure: the rotary layer's only tensor is `cos_sin_cache`, a buffer computed from the
model config that no checkpoint (and no broadcast) contains. vLLM counts buffers as loadable,
finds none loaded, warns, and puts the existing cache back (`_place_kernel_tensors`), which is
right. We drop that one message (`_DerivedBufferFilter`) so real load failures stay visible.

Tied weights (`tie_word_embeddings`: most small real models, SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B)
need one more step. The output head shares the embedding's parameter, so the reload writes the
new values into it through the embedding, and the head loads nothing of its own (vLLM logs
"ParallelLMHead: Failed to load weights" and keeps the head as it was). On GPU that is enough.
On CPU it is not: vLLM packs every GEMM weight into a oneDNN (or sgl) kernel's own buffer when a
layer is processed, and the head is never processed again, so its logits kept coming from the
*initial* weights while the learner trained the tied matrix (the actor sampled from a policy the
learner did not hold: ratio 1.43 on-policy after one update). `_reprocess_tied_layers` runs
vLLM's own processing again for every layer whose weight is shared with another, after each
reload, which repacks the head from the values just loaded. The head has no such message for
us to silence: it names a real gap, which this closes, so it stays visible in the log.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from millstream.actor.receive import WeightReceiver
from millstream.shared.wire.weightsync import gpu_identity, make_group, open_store, session_tag

__all__ = ["WeightSyncExtension"]

log = logging.getLogger(__name__)

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _DerivedBufferFilter(logging.Filter):
    """Drops vLLM's warning about layers whose only tensors are derived buffers (see above)."""

    DERIVED_ONLY = ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message == f"{name}: Failed to load weights" for name in self.DERIVED_ONLY)


def _quiet_derived_buffers() -> None:
    logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _DerivedBufferFilter) for f in logger.filters):
        logger.addFilter(_DerivedBufferFilter())


class WeightSyncExtension:
    """Methods added to every vLLM worker. Called via `collective_rpc(name, args=...)`."""

    # Provided by the vLLM worker this class is mixed into (declared for the type checker).
    device: Any
    model_runner: Any
    reload_weights: Callable[..., Any]

    def millstream_join(
        self,
        session: str,
        host: str,
        port: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        first_rank: int = 1,
    ) -> int:
        """Join the learner's broadcast group as `first_rank` + this worker's rank (every replica
        of a run is in one group, at its own offset)."""
        _quiet_derived_buffers()
        rank = first_rank + int(getattr(self, "rank", 0))
        started = time.monotonic()
        store = open_store(host, port, world_size, is_master=False, timeout_s=timeout_s)
        group = make_group(store, rank, world_size, backend, timeout_s, session)
        # Only now is the old group let go: a failed join leaves the attached session working.
        self.millstream_leave()
        self._ms_group, self._ms_store = group, store
        self._ms_session = session
        self._ms_timeout = timeout_s
        self._ms_threaded = backend == "gloo"  # see actor/receive.py for NCCL
        log.info(
            "joined weight group %s as rank %d/%d in %.2fs",
            session_tag(session),
            rank,
            world_size,
            time.monotonic() - started,
        )
        return rank

    def millstream_device(self) -> str:
        """The GPU this worker computes on (`gpu_identity`; "" on the CPU): the learner picks
        NCCL only when no two members of the group share one (NCCL refuses that)."""
        return gpu_identity(getattr(self, "device", None))

    def millstream_leave(self) -> None:
        """Forget the current group; dropping the last references destroys it (and its store)."""
        self._ms_group = self._ms_store = None

    def _ms_attached(self, session: str) -> Any:
        group = getattr(self, "_ms_group", None)
        if group is None or session != self._ms_session:
            raise RuntimeError(
                f"weight update for session {session!r}, but this worker joined "
                f"{getattr(self, '_ms_session', None)!r}: the learner must attach first"
            )
        return group

    def _ms_receiver(self) -> WeightReceiver:
        receiver = getattr(self, "_ms_kept", None)
        if receiver is None:
            receiver = self._ms_kept = WeightReceiver()
        return receiver

    def millstream_receive(self, session: str, dtype: str, numel: int, piece_ends: list[int]) -> None:
        """Start receiving the update's broadcast into this worker's kept buffer; returns at once
        (the engine keeps generating while the pieces arrive). On NCCL the receive waits for
        `millstream_load`."""
        group = self._ms_attached(session)
        # gloo receives into host memory, whatever the engine computes on: on a GPU that is the
        # path where the learner shares it (the load copies each tensor to the device), and the
        # receive thread then never touches CUDA beside the engine's own streams.
        on_device = not self._ms_threaded and getattr(self, "device", None) is not None
        args = (group, dtype, numel, piece_ends, self.device if on_device else "cpu", self._ms_timeout)
        self._ms_deferred = None if self._ms_threaded else args
        if self._ms_threaded:
            self._ms_receiver().start(*args)

    def millstream_received(self) -> bool:
        """Without blocking: has the whole broadcast arrived? Raises if it failed."""
        return getattr(self, "_ms_deferred", None) is not None or self._ms_receiver().done()

    def millstream_load(self, session: str, tensors: list[tuple[str, list[int], int]]) -> float:
        """Load the received buffer as the model's weights (generation is paused by the caller);
        returns seconds."""
        self._ms_attached(session)
        started = time.monotonic()
        receiver = self._ms_receiver()
        deferred, self._ms_deferred = getattr(self, "_ms_deferred", None), None
        if deferred is not None:
            receiver.start(*deferred, in_thread=False)
        flat = receiver.wait(self._ms_timeout)
        views = (
            (name, flat[offset : offset + math.prod(shape)].view(shape)) for name, shape, offset in tensors
        )
        self.reload_weights(weights_iterator=views)
        model = self.model_runner.get_model()
        _reprocess_tied_layers(model)
        receiver.loaded()
        if receiver.shares_memory_with([*model.parameters(), *model.buffers()]):
            log.warning("the engine kept the receive buffer's memory as weights: it is theirs now")
            receiver.release()  # the next receive must not overwrite them
        return time.monotonic() - started

    def millstream_digest(self) -> tuple[float, float, int]:
        """The digest of the weights this worker loaded last (see `flat_digest`); zeros
        before its first update."""
        return self._ms_receiver().digest()


def _reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Run vLLM's weight processing again on every layer that shares its weight with another
    (tied embeddings), so kernels that packed a copy of it see the values just loaded; returns
    how many layers were processed. See the module's docstring for why."""
    sharing: dict[int, list[tuple[torch.nn.Module, Any]]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None or weight.numel() == 0 or weight.is_meta:
            continue  # no weight, or one a kernel already took over (vLLM left an empty one)
        method = getattr(module, "quant_method", None)
        if method is not None:
            sharing.setdefault(id(weight), []).append((module, method))
    tied = [pair for group in sharing.values() if len(group) > 1 for pair in group]
    for module, method in tied:
        method.process_weights_after_loading(module)
    return len(tied)

"""The actor service: what the envpool asks of an actor, and what streams back.

    envpool DEALER  --GenerateRequest / Abort-->  actor ROUTER
    envpool DEALER  <--TokenDelta / GenerateError--  actor ROUTER
    learner DEALER  --Hello-->  actor ROUTER  --ActorInfo-->

Token ids, logprobs and versions travel as msgpack arrays of numbers, never as text; the hot
messages are `gc=False` (the garbage collector never scans them; they hold no cycles).
"""

from __future__ import annotations

from millstream.shared.wire.base import Id, WireMessage
from millstream.shared.wire.causes import TurnError

__all__ = ["Hello", "ActorInfo", "GenerateRequest", "Abort", "TokenDelta", "GenerateError"]


class Hello(WireMessage, tag="hello", frozen=True):
    """Asks the actor to describe itself; answered by `ActorInfo`."""

    client: str


class ActorInfo(WireMessage, tag="actor_info", frozen=True):
    """The actor's answer to `Hello`."""

    model: str
    #: Policy version of the weights the actor holds now.
    version: int
    #: How many processes hold weights (vLLM workers); the learner's broadcast group has
    #: `weight_ranks + 1` members, the learner being rank 0.
    weight_ranks: int
    #: Longest context (prompt + generation) the engine accepts, in tokens.
    max_model_len: int
    #: Weight dtype in the engine ("float32", "bfloat16", ...); the learner casts to it.
    dtype: str
    #: The GPU each weight rank computes on (`weightsync.gpu_identity`: host and PCI address, as
    #: NCCL tells GPUs apart), in rank order;
    #: empty when they compute on the CPU. The learner broadcasts over NCCL only between
    #: processes on GPUs of their own: NCCL refuses two ranks on one GPU.
    gpus: list[str] = []


class GenerateRequest(WireMessage, tag="gen", gc=False, frozen=True):
    """Generate a continuation of `prompt_token_ids`, streamed back as `TokenDelta`s.

    `request_id` is chosen by the client and is unique among its live requests; replies carry it.
    """

    request_id: Id
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    #: Per-request sampling seed (None: the engine's generator). Seeds flow from the episode so
    #: runs are reproducible.
    seed: int | None = None
    #: Generation stops after emitting one of these (the stop token is included in the output).
    stop_token_ids: list[int] = []
    #: Benchmarks: generate exactly `max_tokens` (no stop on end-of-sequence or stop tokens) and
    #: at least `min_tokens`, so every system compared makes the same amount of work.
    ignore_eos: bool = False
    min_tokens: int = 0
    #: Also return, per generated token, the `top_logprobs` most likely tokens and their
    #: logprobs (0: the sampled token's logprob only, the hot path's case).
    top_logprobs: int = 0


class Abort(WireMessage, tag="abort", gc=False, frozen=True):
    """Stop a request; the actor answers with a final `TokenDelta` whose finish_reason is "abort"."""

    request_id: Id


class TokenDelta(WireMessage, tag="delta", gc=False, frozen=True):
    """New tokens of one request, in order, with the logprob of each under the sampling policy.

    `version` is a lower bound of the weights that produced every token of the delta: never
    newer, and at most one version older around a weight update (the vLLM actor cannot see
    which step of a batched handover came before an update, actor/stream.py `Deltas`). A
    sequence that spans a weight update is a series of deltas with non-decreasing versions.
    """

    request_id: Id
    token_ids: list[int]
    logprobs: list[float]
    version: int
    #: None while the request runs; "stop", "length" or "abort" on the last delta.
    finish_reason: str | None = None
    #: On the last delta: requests the replica held live as it sent it (-1: not reported).
    #: The envpool's router sends new episodes to the replica with the least of them.
    load: int = -1
    #: With the request's `top_logprobs` > 0: per token, the most likely (token id, logprob)
    #: pairs, most likely first; empty otherwise.
    top_logprobs: list[list[tuple[int, float]]] = []
    #: Where the delta's first token sits in the request's output: the number of tokens the
    #: actor sent it before (-1: not said). A client that received another number fails the
    #: turn: a delta between was lost, and its tokens must not be trained on as if whole.
    offset: int = -1


class GenerateError(WireMessage, tag="gen_error", frozen=True):
    """A request failed inside the actor (bad prompt, engine error). Ends that request."""

    request_id: Id
    cause: TurnError
    message: str

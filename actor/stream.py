"""One request's stream: the sampling parameters vLLM runs it with, and how its engine outputs
become `TokenDelta`s, each labelled with one policy version.

The label is the part that needs care. Which weights made a token is not visible in an engine
output, and a weight update can land between two outputs of a request, so `Deltas` labels every
output with a version no newer than the weights that made it (its docstring says why "the
version of two reads before" is safe). The learner's staleness bound then never admits a token
that is too old; at worst it is a little stricter around an update. actor/server.py reads the
engine's stream and sends what `Deltas` hands back.
"""

from __future__ import annotations

from typing import Any

from millstream.shared.wire import GenerateRequest, TokenDelta

__all__ = ["Deltas", "sampling_params"]


class Deltas:
    """Tokens of one request waiting to be streamed, all labelled with one policy version.

    A request's first tokens go at once (`due`): the time to first token is what a streaming
    consumer waits on (an agent's tool call mid-reply, an early stop), and vLLM hands its first
    output over alone too. After that tokens wait until `interval` of them are there (fewer,
    larger messages at scale); a label change sends the waiting ones first, so each delta has
    one version.

    Which version made a token is not visible in an engine output, so the label is a lower
    bound. vLLM hands a request's tokens over `stream_interval` at a time and keeps the rest
    (up to `stream_interval - 1` tokens, sampled earlier) for a later output; an output this
    task reads may also have waited while it was sending. Every token of the output read k was
    sampled after output k-1 was put out, which was after this task read output k-2 (the
    request itself counts as read -1 and -2). So output k is labelled with the version current
    when output k-2 was read: versions only grow, so no token is ever labelled newer than the
    weights that made it; around an update up to two outputs are labelled one version older,
    which the learner's staleness bound only makes stricter.
    """

    __slots__ = ("request_id", "ids", "logprobs", "top", "version", "seen", "seen_before", "sent")

    def __init__(self, request_id: str, version: int) -> None:
        self.request_id = request_id
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.version = version  # the label of the waiting tokens
        self.seen = version  # the version when the last output was read
        self.seen_before = version  # ... and the one before it
        self.sent = 0  # tokens taken into deltas so far: the next delta's offset

    def add(
        self,
        ids: list[int],
        logprobs: list[float],
        now: int,
        top: list[list[tuple[int, float]]] | None = None,
    ) -> TokenDelta | None:
        """Take one engine output read at version `now`; returns the waiting tokens as a
        delta when they must go first (their label differs from the new tokens')."""
        label, self.seen_before, self.seen = self.seen_before, self.seen, now
        first = self.take() if self.ids and label != self.version else None
        self.version = label
        self.ids += ids
        self.logprobs += logprobs
        if top:
            self.top += top
        return first

    def due(self, interval: int) -> bool:
        """Whether the waiting tokens go now: the request's first ones at once, then
        `interval` at a time."""
        return bool(self.ids) and (not self.sent or len(self.ids) >= interval)

    def take(self, finish: str | None = None, load: int = -1) -> TokenDelta:
        ids, sent = self.ids, self.sent
        delta = TokenDelta(self.request_id, ids, self.logprobs, self.version, finish, load, self.top, sent)
        self.ids, self.logprobs, self.top = [], [], []
        self.sent += len(ids)
        return delta


def sampling_params(req: GenerateRequest, stream_interval: int = 1) -> Any:
    """vLLM's sampling parameters for a request: one sequence, streamed as deltas, token ids only,
    the sampled token's logprob. Built inside the request's error boundary: vLLM validates here.

    `stream_interval` makes vLLM's output processor hand over tokens `stream_interval` at a time
    (the first and the last at once), the size of the deltas the actor sends anyway: the per-token
    wake-ups of this process (output queue, request task, this loop) fall by that factor, and on
    a machine where the engine has every core that is throughput (bench/README.md, overhead)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        seed=req.seed,
        stop_token_ids=[] if req.ignore_eos else list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=req.top_logprobs,  # 0: the sampled token's logprob only
        output_kind=RequestOutputKind.DELTA,
        stream_interval=stream_interval,
        detokenize=False,  # token in, token out: text is the envpool's business
        skip_special_tokens=False,
    )

"""The token record of one episode, whichever way it is played: env turns, agent calls, the debugger.

An episode's record is the token ids of every context the episode used, concatenated, and the
generated spans within them (each reply's logprobs and policy versions, and whether it is
trained), plus per turn: where its reply starts and ends, its reward, the request that made it,
and `texts` alternating observation and reply. The per-token loss mask, logprobs and versions
are laid out only when the episode ends (`token_lists`): while it runs, three lists as long as
its context would mostly repeat "no loss, 0.0, -1" for prompt tokens, and at 10,000 live
episodes that is megabytes.

`segment` is where the context the model currently sees begins: 0 unless the environment
asked for a fresh context (Delethink) or an agent's call did not extend the context so far; each
new segment's start is listed in `segment_starts`, and the learner trains each segment as its
own sequence.

The record becomes a `Trajectory` when the episode ends, or the `Scene` of an `EpisodeFailed`
(what happened up to the failure, for the trajectory store) when it fails. Prompt tokens carry
no loss, logprob 0.0 and version -1; generated tokens carry the actor's logprobs and versions,
and loss only where the turn is trained. The model's text is never re-tokenized into the record.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

from millstream.envpool.actors.generation import Generation, GenerationFailed
from millstream.shared.wire import Cause, EpisodeFailed, Scene, Trajectory, Truncation

__all__ = ["EpisodeSpec", "EpisodeRecord", "episode_failed"]


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    """Which episode this is: its ids, its group, the seed that picks its task."""

    episode_id: str
    group_id: str
    seed: int
    member: int
    group_size: int
    env_name: str


def episode_failed(
    spec: EpisodeSpec, cause: Cause, message: str, scene: Scene | None = None
) -> EpisodeFailed:
    """An episode's failure, with its cause (counted, never scored) and a bounded message."""
    return EpisodeFailed(spec.episode_id, spec.group_id, spec.group_size, cause, message[:500], scene)


class EpisodeRecord:
    """The growing record of one episode (see the module docstring for its layout)."""

    __slots__ = (
        "spec",
        "started",
        "ids",
        "spans",
        "segment",
        "segment_starts",
        "rewards",
        "turn_starts",
        "turn_ends",
        "texts",
        "request_ids",
        "anchors",
        "invalid_actions",
        "truncated",
        "success",
        "closed",
    )

    def __init__(self, spec: EpisodeSpec) -> None:
        self.spec = spec
        self.started = time.monotonic()
        self.ids: list[int] = []
        #: Generated tokens: (start and end in `ids`, trained, their logprobs, their versions),
        #: packed (`_pack_reply`).
        self.spans: list[tuple[int, int, bool, array[float], int | list[int]]] = []
        self.segment = 0
        self.segment_starts: list[int] = []
        self.rewards: list[float] = []
        self.turn_starts: list[int] = []
        self.turn_ends: list[int] = []
        self.texts: list[str] = []
        self.request_ids: list[str] = []
        self.anchors: list[str] = []
        self.invalid_actions = 0
        self.truncated: Truncation | None = None
        self.success: bool | None = None
        #: Set when the episode ended: the trajectory holds these lists, nothing may append.
        self.closed = False

    # --- the context -----------------------------------------------------------------------

    @property
    def turns(self) -> int:
        """Replies recorded so far."""
        return len(self.turn_starts)

    def visible(self) -> list[int]:
        """The context the model currently sees.

        In the first segment that is `ids` itself, not a copy: an episode waits on its request
        with its prompt in hand, and at 10,000 live episodes a copy each is megabytes. The
        request is encoded when it is sent (envpool/actors/client.py), and the record grows
        only after the reply, so the list may be shared. Do not change what this returns.
        """
        return self.ids if self.segment == 0 else self.ids[self.segment :]

    def visible_length(self) -> int:
        """How many tokens the model currently sees."""
        return len(self.ids) - self.segment

    def last_reply(self) -> list[int]:
        """The token ids of the last reply (a copy)."""
        return self.ids[self.turn_starts[-1] : self.turn_ends[-1]]

    def extends(self, prompt_ids: list[int]) -> bool:
        """Does `prompt_ids` continue the current context token for token?"""
        seen = self.visible()
        return len(prompt_ids) >= len(seen) and prompt_ids[: len(seen)] == seen

    def start_segment(self) -> None:
        """A fresh context begins here."""
        self.segment = len(self.ids)
        self.segment_starts.append(self.segment)

    def add_prompt(self, ids: list[int]) -> None:
        """Tokens the model reads and is not trained on (no loss, logprob 0.0, version -1)."""
        self.ids.extend(ids)

    def add_reply(self, gen: Generation, *, trained: bool = True, anchor: str = "") -> None:
        """One turn's generated tokens, with their logprobs and versions (packed: `_pack_reply`)."""
        start = len(self.ids)
        self.turn_starts.append(start)
        self.request_ids.append(gen.request_id)
        self.anchors.append(anchor)
        self.ids.extend(gen.token_ids)
        self.spans.append((start, len(self.ids), trained, *_pack_reply(gen)))
        self.turn_ends.append(len(self.ids))

    def token_lists(self) -> tuple[list[int], list[float], list[int]]:
        """Per token of `ids`: the loss mask, the behaviour logprobs and the policy versions."""
        n = len(self.ids)
        mask, logprobs, versions = [0] * n, [0.0] * n, [-1] * n
        for start, end, trained, span_logprobs, span_versions in self.spans:
            if trained:
                mask[start:end] = [1] * (end - start)
            # Cut to the span, so a generation whose lists disagree cannot shift the others.
            span_logprobs = span_logprobs[: end - start]
            logprobs[start : start + len(span_logprobs)] = span_logprobs.tolist()
            if isinstance(span_versions, int):
                versions[start:end] = [span_versions] * (end - start)
            else:
                span_versions = span_versions[: end - start]
                versions[start : start + len(span_versions)] = span_versions
        return mask, logprobs, versions

    def add_call(self, prompt_ids: list[int], gen: Generation, text: str) -> bool:
        """One model call of an agent: its prompt (only what extends the context) and reply.

        Returns whether the call started a new segment (its prompt did not extend the context).
        """
        if self.closed:
            return False
        fresh = bool(self.ids) and not self.extends(prompt_ids)
        if fresh:
            self.start_segment()
        self.add_prompt(prompt_ids[self.visible_length() :])
        self.add_reply(gen, anchor=f"call{self.turns}")
        self.rewards.append(0.0)  # the agent's reward is the episode's, set on the last call
        # `texts` alternates observation and reply; an agent's "observation" is the messages it
        # sent, which are in the tokens: left empty here, not decoded again.
        self.texts += ["", text]
        return fresh

    # --- the outcome -----------------------------------------------------------------------

    def scene(self, failed: GenerationFailed | None = None, *, always: bool = False) -> Scene | None:
        """What the episode had done, and the request that failed, if one did.

        None for an episode that failed before its first prompt (nothing to see), unless
        `always`: an agent's episode keeps its seed and duration even when the agent failed
        before it called the model.
        """
        if not self.ids and failed is None and not always:
            return None
        request = failed.as_request(len(self.rewards)) if failed is not None else None
        mask, logprobs, versions = self.token_lists()
        return Scene(
            self.spec.env_name,
            self.spec.seed,
            self.ids,
            mask,
            logprobs,
            versions,
            self.rewards,
            self.turn_starts,
            self.turn_ends,
            self.texts,
            self.request_ids,
            time.monotonic() - self.started,
            request,
        )

    def failed(self, cause: Cause, message: str, failure: GenerationFailed | None = None) -> EpisodeFailed:
        """The episode's `EpisodeFailed`, with what it had done as its scene."""
        return episode_failed(self.spec, cause, message, self.scene(failure))

    def trajectory(self) -> Trajectory:
        """The finished episode; the record is closed (the trajectory holds its lists)."""
        self.closed = True
        spec = self.spec
        mask, logprobs, versions = self.token_lists()
        return Trajectory(
            episode_id=spec.episode_id,
            group_id=spec.group_id,
            seed=spec.seed,
            env=spec.env_name,
            token_ids=self.ids,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            reward=sum(self.rewards),
            turn_rewards=self.rewards,
            num_turns=len(self.rewards),
            group_size=spec.group_size,
            duration_s=time.monotonic() - self.started,
            turn_starts=self.turn_starts,
            turn_ends=self.turn_ends,
            anchors=self.anchors,
            texts=self.texts,
            segment_starts=self.segment_starts,
            invalid_actions=self.invalid_actions,
            truncated=self.truncated,
            success=self.success,
            request_ids=self.request_ids,
        )


def _pack_reply(gen: Generation) -> tuple[array[float], int | list[int]]:
    """A reply's logprobs as doubles, and its versions as one int when one policy made it all.

    A live episode holds every reply it made until it ends; as Python lists, each token's
    logprob is a float object (24 bytes plus its 8-byte slot) and its version another slot.
    Packed, a 24-token reply holds about 200 bytes instead of 1,000. Per turn that is one copy
    into an array and one count; the lists are laid out again only when the episode ends.
    """
    versions = gen.versions
    if versions and len(versions) == len(gen.token_ids) and versions.count(versions[0]) == len(versions):
        return array("d", gen.logprobs), versions[0]
    return array("d", gen.logprobs), versions

"""The wire protocol: every message that crosses a process boundary.

The roles (envpool, actor, learner) talk only through these structs, so this file is the
documentation of the wire. Each ZeroMQ frame carries one `Packet`: a protocol version and a list
of messages. Packing several messages into one frame is how senders coalesce the small, frequent
messages (token deltas, requests) of one tick into a single send.

Encoding is msgpack through msgspec. Messages form a tagged union (the tag is the class name, kept
short on the wire by `tag=` below), so one decoder reads every frame. Messages are
`array_like=True` (encoded as arrays, not maps: smaller, faster), and the hot ones `gc=False`
(the garbage collector never scans them; they hold no reference cycles). Token ids, logprobs and versions
travel as msgpack arrays of numbers, never as text.

Failure causes (`Cause`, `TurnError`, `DropCause`, `ReplyCause`, `Truncation`) are enums defined
in `shared/causes.py` and re-exported here: they are part of the wire.

A frame that fails to decode raises `ProtocolError`; receivers count it and answer with an
`ErrorReply`, they never crash (see `Codec.decode`).

Channels, and who sends what:

    envpool DEALER  ──GenerateRequest / Abort──▶  actor ROUTER
    envpool DEALER  ◀──TokenDelta / GenerateError──  actor ROUTER
    learner DEALER  ──Hello / AttachLearner / WeightUpdate──▶  actor ROUTER
    learner DEALER  ◀──ActorInfo / WeightsApplied / ErrorReply──  actor ROUTER
    any DEALER      ──DigestWeights──▶  actor ROUTER ──WeightsDigest──▶
    envpool PUSH    ──Trajectory / EpisodeFailed / PoolDone / EvalResult──▶  learner PULL
    actor PUSH      ──ReplicaJoin / ReplicaLeave──▶  learner PULL
    learner PUB     ──PolicyVersion (with the live replicas)──▶  envpool SUB

An actor replica is one engine behind one ROUTER. A run has one or more; the learner keeps the
list of those that hold its current weights and announces it in every `PolicyVersion`, and each
envpool worker routes its episodes among them (envpool/router.py).
"""

from __future__ import annotations

import msgspec

from .causes import (
    ACTOR_CAUSES,
    RETRYABLE_CAUSES,
    TURN_CAUSE,
    Cause,
    DropCause,
    ReplyCause,
    Truncation,
    TurnError,
)

__all__ = [
    "PROTOCOL_VERSION",
    "TurnError",
    "Cause",
    "ACTOR_CAUSES",
    "RETRYABLE_CAUSES",
    "TURN_CAUSE",
    "Truncation",
    "DropCause",
    "ReplyCause",
    "Hello",
    "ActorInfo",
    "GenerateRequest",
    "Abort",
    "TokenDelta",
    "GenerateError",
    "AttachLearner",
    "WeightUpdate",
    "WeightsApplied",
    "TensorSpec",
    "Trajectory",
    "EpisodeFailed",
    "FailedRequest",
    "Scene",
    "PoolDone",
    "WorkerHello",
    "GroupStarted",
    "EvalResult",
    "PolicyVersion",
    "ReplicaRef",
    "ReplicaJoin",
    "ReplicaLeave",
    "DigestWeights",
    "WeightsDigest",
    "group_id",
    "group_number",
    "admit_limit",
    "ErrorReply",
    "Message",
    "Packet",
    "Codec",
    "ProtocolError",
]

#: Bumped on any incompatible change of a message below. A peer with another version is refused
#: with a clear error instead of misreading fields.
PROTOCOL_VERSION = 6


class ProtocolError(ValueError):
    """A frame could not be decoded, or carried another protocol version."""


class _Wire(msgspec.Struct, array_like=True, frozen=True):
    """Base of every message: encoded as a tagged array (the union needs one layout for all).

    Each message repeats `frozen=True`: msgspec inherits it anyway, type checkers do not."""


# --- actor service ---------------------------------------------------------------------------


class Hello(_Wire, tag="hello", frozen=True):
    """Asks the actor to describe itself; answered by `ActorInfo`."""

    client: str


class ActorInfo(_Wire, tag="actor_info", frozen=True):
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


class GenerateRequest(_Wire, tag="gen", gc=False, frozen=True):
    """Generate a continuation of `prompt_token_ids`, streamed back as `TokenDelta`s.

    `request_id` is chosen by the client and is unique among its live requests; replies carry it.
    """

    request_id: str
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


class Abort(_Wire, tag="abort", gc=False, frozen=True):
    """Stop a request; the actor answers with a final `TokenDelta` whose finish_reason is "abort"."""

    request_id: str


class TokenDelta(_Wire, tag="delta", gc=False, frozen=True):
    """New tokens of one request, in order, with the logprob of each under the sampling policy.

    `version` is a lower bound of the weights that produced every token of the delta: never
    newer, and at most one version older around a weight update (the vLLM actor cannot see
    which step of a batched handover came before an update, actor/server.py `_Deltas`). A
    sequence that spans a weight update is a series of deltas with non-decreasing versions.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    #: None while the request runs; "stop", "length" or "abort" on the last delta.
    finish_reason: str | None = None
    #: On the last delta: requests the replica held live as it sent it (-1: not reported).
    #: The envpool's router sends new episodes to the replica with the least of them.
    load: int = -1


class GenerateError(_Wire, tag="gen_error", frozen=True):
    """A request failed inside the actor (bad prompt, engine error). Ends that request."""

    request_id: str
    cause: TurnError
    message: str


# --- weight synchronisation (learner -> actor) -------------------------------------------------


class AttachLearner(_Wire, tag="attach", frozen=True):
    """Join the learner's weight-broadcast group (a fresh one per learner session).

    The learner is rank 0 and hosts the TCPStore at `host:port`; this replica's workers take
    ranks `first_rank .. first_rank + weight_ranks - 1` (every replica of the run is in the one
    group, each at its own offset). Attaching again with a new `session` replaces the previous
    group, so a restarted learner, or a fleet that gained or lost a replica, forms a new one.
    """

    session: str
    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    first_rank: int = 1


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One named tensor's place in the flat broadcast buffer (elements, not bytes)."""

    name: str
    shape: list[int]
    offset: int


class WeightUpdate(_Wire, tag="weights", frozen=True):
    """Weights of `version` follow as one broadcast of a flat `dtype` buffer of `numel` elements.

    The actor pauses generation (requests keep their state), receives the broadcast in its
    workers, reloads the weights, resumes, and answers `WeightsApplied`.
    """

    session: str
    version: int
    dtype: str
    numel: int
    tensors: list[TensorSpec]


class WeightsApplied(_Wire, tag="weights_applied", frozen=True):
    """The actor now generates with `version`."""

    version: int
    #: Time generation was paused for the update, seconds.
    paused_s: float
    #: Tokens this replica generated since it started (the learner reports each one's share).
    tokens: int = 0


class DigestWeights(_Wire, tag="digest", frozen=True):
    """Asks the actor for a digest of the weights its engine loaded last; answered by
    `WeightsDigest`."""


class WeightsDigest(_Wire, tag="weights_digest", frozen=True):
    """Sum and sum of magnitudes (float64) and count of the flat buffer every worker of the
    replica loaded at its last update, taken once vLLM's reload returned (each TP worker loads
    the whole buffer and keeps its shard). Equal to the learner's digest of what it sent: the
    replica loaded exactly the learner's weights of `version`.

    Why not read the weights back: vLLM's CPU backend repacks linear layers into its own
    kernels' layout (their tensors are no longer the model's parameters), and padded or sharded
    tensors would not sum to the learner's anyway."""

    version: int
    total: float
    abs_total: float
    numel: int


# --- experience (envpool -> learner) -----------------------------------------------------------


class Trajectory(_Wire, tag="traj", gc=False, frozen=True):
    """One finished episode, token in / token out.

    `token_ids` is the whole multi-turn context as the model saw it. `loss_mask[i]` is 1 where
    token i was generated by the model (only those tokens carry loss); `logprobs[i]` and
    `versions[i]` are the behaviour logprob and policy version of generated tokens (0.0 and -1
    elsewhere). A generated turn the environment marked untrained (AgentFlow's executor and
    verifier) keeps its logprobs and versions but has loss_mask 0.
    """

    episode_id: str
    group_id: str
    #: Episodes of one group share the environment seed (GRPO compares them with each other).
    seed: int
    env: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    #: Episode return: the sum of `turn_rewards`.
    reward: float
    turn_rewards: list[float]
    num_turns: int
    #: Size of the group this episode belongs to, so the learner knows when a group is complete.
    group_size: int
    #: Wall time of the episode, seconds.
    duration_s: float
    #: Token range [turn_starts[t], turn_ends[t]) of turn t's generated response, so per-turn
    #: rewards and step-level advantages can be placed on the right tokens.
    turn_starts: list[int] = []
    turn_ends: list[int] = []
    #: Canonical anchor of the state each turn acted on (GiGPO groups equal anchors).
    anchors: list[str] = []
    #: Decoded text for inspection only: observation, reply, observation, ... (turn t's are
    #: texts[2t] and texts[2t + 1]; an agent episode's observations are empty: they are its
    #: own messages, in the tokens).
    texts: list[str] = []
    #: Where a fresh context begins after the first (Delethink chunks): `token_ids` is then the
    #: concatenation of independent contexts, and the learner trains each as its own sequence.
    segment_starts: list[int] = []
    #: Turns whose action the environment could not parse or rejected (format penalty given).
    invalid_actions: int = 0
    #: Set when the episode was cut before the environment said done (it is still trained).
    truncated: Truncation | None = None
    #: The environment's `info["success"]` on the episode's last turn (None: it never said).
    success: bool | None = None
    #: The id of the generation request that produced each turn (a call can be found by it).
    request_ids: list[str] = []


class FailedRequest(msgspec.Struct, array_like=True, frozen=True):
    """A generation request that ended without its final delta: what had arrived, and why."""

    request_id: str
    turn: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    error: str


class Scene(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a failed episode had done when it failed (the "scene of the accident"): the context
    so far, in `Trajectory`'s layout, and the request that was live, if one was."""

    env: str
    seed: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turn_rewards: list[float]
    turn_starts: list[int]
    turn_ends: list[int]
    texts: list[str]
    request_ids: list[str]
    duration_s: float
    request: FailedRequest | None = None


class EpisodeFailed(_Wire, tag="failed", frozen=True):
    """An episode ended without a trainable trajectory. Never scored as a reward."""

    episode_id: str
    group_id: str
    group_size: int
    cause: Cause
    message: str
    #: The episode's state when it failed (None where nothing was played, or not recorded).
    scene: Scene | None = None


class PoolDone(_Wire, tag="pool_done", frozen=True):
    """The last message of an envpool worker: its totals, for exact accounting."""

    worker: str
    episodes_started: int
    episodes_finished: int
    episodes_failed: int


class WorkerHello(_Wire, tag="worker_hello", frozen=True):
    """An envpool worker process introduces itself to a learner session: the first message it
    pushes after it sees a session's first `PolicyVersion` (a restarted learner is a new one).

    `incarnation` is new for every process. When worker `index` says hello with a new one, its
    previous process is gone: the learner closes that process's unfinished groups, counting
    each missing member as `worker_lost`. The counts let a restarted learner find the episodes
    that reached its dead predecessor after its checkpoint (`learner_lost`), and `next_group`
    where numbering may safely continue.
    """

    index: int
    incarnation: str
    #: Episodes this process started, and whose results it pushed, so far.
    started: int = 0
    reported: int = 0
    #: Episodes still running, by id (`<gid>-e<m>`).
    live: list[str] = []
    #: The group number this process would start next.
    next_group: int = 0


class GroupStarted(_Wire, tag="group_started", frozen=True):
    """Worker `index` (process `incarnation`) started group `group_id`, members `<gid>-e<m>`.

    Sent before any member can finish, so the learner knows every episode that was started,
    even one whose worker dies before it reports.
    """

    index: int
    incarnation: str
    group_id: str
    group_size: int


class EvalResult(_Wire, tag="eval_result", frozen=True):
    """One evaluation round's results (envpool/evaluator.py): `problems` problems, `samples`
    episodes each, played with the policy of `version` or later (the actor may update its
    weights during the round: `token_versions` is the [min, max] version of their tokens).

    Evaluation episodes are never trained on and are not in the run's episode accounting; a
    failed one is counted under its cause in `failed` and left out of every mean."""

    worker: str
    #: The announced policy version that started the round.
    version: int
    env: str
    problems: int
    samples: int
    #: Episodes that ended with a trajectory (the rest are in `failed`).
    finished: int
    failed: dict[str, int]
    #: Mean return of the finished episodes (0.0 when none finished).
    reward_mean: float
    #: Share of finished episodes whose environment said success.
    success: float
    #: Share of problems with at least one finished episode of which one succeeded.
    pass_at_k: float
    token_versions: list[int]
    duration_s: float
    #: The round hit `eval.timeout_s`; its unfinished episodes are in `failed`.
    timed_out: bool = False


class PolicyVersion(_Wire, tag="version", frozen=True):
    """The learner's policy version and the admission bound derived from it.

    Groups are numbered over the whole run (`group_id(n)`); an envpool worker may start group `n`
    only while `n < admit_limit`. The learner computes the limit (the staleness rule, in
    envpool/gate.py's docstring) because only it knows how many groups were trained or dropped,
    and, after a resume, where numbering continues (`group_base`).
    """

    version: int
    #: Group numbers below this may be started.
    admit_limit: int
    #: First group number of this learner session: a resumed run continues numbering (and
    #: environment seeds) after every group the previous session saw.
    group_base: int = 0
    #: True once the learner has finished: workers stop admitting and report `PoolDone`.
    final: bool = False
    #: Per worker index, the group number its next process continues from (after the groups
    #: its earlier processes started); empty until a worker started a group.
    next_groups: list[int] = []
    #: The learner session; a new one (a restarted learner) makes every worker say hello again.
    session: str = ""
    #: The actor replicas that hold this version's weights and take requests. None: the learner
    #: names none, and workers use the configured `actor.connect` / `actor.address`.
    replicas: list[ReplicaRef] | None = None


class ReplicaRef(msgspec.Struct, array_like=True, frozen=True):
    """A replica the learner attached: where it listens, and `epoch`, which grows every time the
    learner (re)attaches it. A worker whose connection to a replica dropped sends it nothing
    until a larger epoch says that the learner brought it (or its restart) to its weights."""

    name: str
    address: str
    epoch: int


class ReplicaJoin(_Wire, tag="replica_join", frozen=True):
    """An actor replica started by hand (`millstream actor --join`) asks the run to take it.

    The learner attaches it, pushes the current weights, then announces it; only then does any
    episode send it a request. Sent again every few seconds until the learner attaches.
    """

    name: str
    address: str
    incarnation: str


class ReplicaLeave(_Wire, tag="replica_leave", frozen=True):
    """A replica is draining (SIGTERM): the learner stops announcing it and forms its weight
    group without it; its live turns finish, or move to other replicas."""

    name: str
    incarnation: str


def admit_limit(
    *, group_base: int, consumed: int, carried: int, groups_per_batch: int, max_staleness: int, slack: int
) -> int:
    """The `PolicyVersion.admit_limit` the learner announces (envpool/gate.py explains why).

    `consumed`: groups of this learner session trained or dropped; `carried`: groups that hold
    a slot without having been admitted by this session (the learner passes 0: see
    learner/main.py `_all_greeted`). For a fresh run this is AReaL's `(v + k + 1 + slack) * B` plus
    the dropped groups.
    """
    return group_base + (max_staleness + 1 + slack) * groups_per_batch + consumed - carried


def group_id(number: int) -> str:
    """The wire name of group `number` (numbers are global over a run)."""
    return f"g{number}"


def group_number(gid: str) -> int:
    """Inverse of `group_id`; raises ValueError naming the id if it is not one."""
    if not gid.startswith("g") or not gid[1:].isdigit():
        raise ValueError(f"not a group id: {gid!r} (expected 'g<number>')")
    return int(gid[1:])


class ErrorReply(_Wire, tag="error", frozen=True):
    """Answer to a frame that could not be handled (malformed, wrong protocol, unknown kind)."""

    cause: ReplyCause
    message: str


#: Every message kind; a frame's messages decode to one of these by their tag.
Message = (
    Hello
    | ActorInfo
    | GenerateRequest
    | Abort
    | TokenDelta
    | GenerateError
    | AttachLearner
    | WeightUpdate
    | WeightsApplied
    | Trajectory
    | EpisodeFailed
    | PoolDone
    | WorkerHello
    | GroupStarted
    | EvalResult
    | PolicyVersion
    | ReplicaJoin
    | ReplicaLeave
    | DigestWeights
    | WeightsDigest
    | ErrorReply
)


class Packet(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One ZeroMQ frame: the sender's protocol version and the messages of one tick."""

    protocol: int
    messages: list[Message]


class Codec:
    """Encodes and decodes frames; reuses msgspec's encoder and decoder (they keep buffers).

    `decode` turns every failure into `ProtocolError` with a message that says what was wrong,
    and counts it in `errors`, so a receive loop can answer and keep serving.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Packet)
        # Reads only the version, so a peer of another version is named as such even when its
        # messages do not decode under this one's types.
        self._version = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
        self.errors = 0

    def encode(self, messages: list[Message]) -> bytes:
        return self._encoder.encode(Packet(PROTOCOL_VERSION, messages))

    def decode(self, frame: bytes | memoryview) -> list[Message]:
        try:
            packet = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.errors += 1
            raise ProtocolError(
                self._other_version(frame) or f"malformed frame ({len(frame)} bytes): {exc}"
            ) from None
        if packet.protocol != PROTOCOL_VERSION:
            self.errors += 1
            raise ProtocolError(self._mismatch(packet.protocol))
        return packet.messages

    def _other_version(self, frame: bytes | memoryview) -> str | None:
        try:
            version, _ = self._version.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return self._mismatch(version) if version != PROTOCOL_VERSION else None

    @staticmethod
    def _mismatch(version: int) -> str:
        return f"peer speaks protocol {version}, this process speaks {PROTOCOL_VERSION}"

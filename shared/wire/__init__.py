"""The wire: every message that crosses a process boundary, and how it crosses.

    protocol.py    the frame: protocol version, the union of every message, the codec
    generation.py  the actor service: requests, token deltas, errors
    weights.py     weight synchronisation messages (the weights go over weightsync's group)
    experience.py  episodes and a worker's bookkeeping, envpool -> learner
    control.py     policy versions, admission, replicas, group numbering, error replies
    causes.py      why something ended without a result (enums that travel in messages)
    base.py        the base every message derives from
    transport.py   ZeroMQ sockets driven from anyio (trio or asyncio), bounded and observable
    keys.py        the run's CURVE keys: who may talk to its sockets, who may attach as learner
    weightsync.py  how learner and actor form the weight-broadcast group (gloo / NCCL)
    replicas.py    names and addresses of a run's actor replicas

The messages are re-exported here, so a role writes `from millstream.shared.wire import
Trajectory`; the other modules are imported by name (`millstream.shared.wire.transport`), and
importing this package does not import ZeroMQ or torch.
"""

from millstream.shared.wire.causes import (
    ACTOR_CAUSES,
    RETRYABLE_CAUSES,
    TURN_CAUSE,
    Cause,
    DropCause,
    ReplyCause,
    Truncation,
    TurnError,
)
from millstream.shared.wire.control import (
    ErrorReply,
    PolicyVersion,
    ReplicaJoin,
    ReplicaLeave,
    ReplicaRef,
    Settled,
    admit_limit,
    group_id,
    group_number,
    group_of,
    member_id,
)
from millstream.shared.wire.experience import (
    MAX_COUNT,
    MAX_PREDECESSORS,
    EpisodeFailed,
    EvalResult,
    FailedRequest,
    GroupStarted,
    PoolDone,
    Predecessor,
    Resent,
    Scene,
    Trajectory,
    WorkerHello,
)
from millstream.shared.wire.generation import (
    Abort,
    ActorInfo,
    GenerateError,
    GenerateRequest,
    Hello,
    TokenDelta,
)
from millstream.shared.wire.protocol import (
    PROTOCOL_VERSION,
    Codec,
    Message,
    Outgoing,
    Packet,
    ProtocolError,
)
from millstream.shared.wire.weights import (
    AttachLearner,
    DigestWeights,
    TensorSpec,
    WeightsApplied,
    WeightsDigest,
    WeightUpdate,
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
    "Resent",
    "Predecessor",
    "MAX_PREDECESSORS",
    "MAX_COUNT",
    "WorkerHello",
    "GroupStarted",
    "EvalResult",
    "PolicyVersion",
    "ReplicaRef",
    "Settled",
    "ReplicaJoin",
    "ReplicaLeave",
    "DigestWeights",
    "WeightsDigest",
    "group_id",
    "group_number",
    "group_of",
    "member_id",
    "admit_limit",
    "ErrorReply",
    "Message",
    "Outgoing",
    "Packet",
    "Codec",
    "ProtocolError",
]

"""envpool: thousands of environment episodes as tasks on one event loop (trio by default).

Layout:
- `envs/`     environments (text in, text out) and their registry;
- `chat.py`   token-in/token-out chat context (the envpool owns tokenization);
- `client.py` many episodes' generation requests over one DEALER socket to the actor;
- `episode.py` one episode: reset, generate, step, ... -> Trajectory or EpisodeFailed;
- `gate.py`   the staleness-bounded admission gate;
- `worker.py` the worker process: admission, concurrency, reporting to the learner, statistics.

This package never imports torch or vllm: it talks to the actor and learner only through
`shared.protocol` messages.
"""

from millstream.envpool.actors.client import ActorClient, ActorUnreachable, Generation, GenerationFailed
from millstream.envpool.chat import ChatFormat
from millstream.envpool.episode import EpisodeSpec, run_episode
from millstream.envpool.gate import AdmissionGate
from millstream.envpool.worker import WorkerStats, run_worker

__all__ = [
    "ChatFormat",
    "ActorClient",
    "ActorUnreachable",
    "Generation",
    "GenerationFailed",
    "EpisodeSpec",
    "run_episode",
    "AdmissionGate",
    "run_worker",
    "WorkerStats",
]

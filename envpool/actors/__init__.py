"""The envpool's link to the actor replicas.

- `generation.py` a turn's `Sampling`, its `Generation` or `GenerationFailed`, the one retry policy;
- `client.py` many episodes' generation requests over one DEALER socket to one replica;
- `pending.py` one request in flight: its generation as it streams in, and its waiting episode;
- `router.py` one worker's turns spread over the run's replicas (affinity, shedding, retries).
"""

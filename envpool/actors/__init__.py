"""The envpool's link to the actor replicas.

client.py   many episodes' generation requests over one DEALER socket to one replica
router.py   one worker's turns spread over the run's replicas (affinity, shedding, retries)
"""

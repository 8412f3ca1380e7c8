"""The learner's half of weight synchronisation.

weights.py  the links to the replicas, the group, the push (one broadcast group)
layout.py   the flat layout of a push and its pieces: large tensors sent as they lie, small packed
fleet.py    the run's replicas: which hold the current weights, joins, losses, restarts
"""

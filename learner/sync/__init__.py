"""The learner's half of weight synchronisation.

weights.py  flattening and broadcasting weights to the actor replicas (one group)
fleet.py    the run's replicas: which hold the current weights, joins, losses, restarts
"""

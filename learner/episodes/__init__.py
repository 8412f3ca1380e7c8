"""Episodes arriving at the learner, and the account of every episode's fate.

experience.py  rank 0's sockets to the envpool (PULL episodes, PUB versions), progress lines
intake.py      each arriving message inside its own error boundary
validate.py    the checks on every episode before the replay buffer takes it
workers.py     which groups each envpool worker started (no death loses an episode)
lineages.py    what the ledger keeps of each worker process's groups, to read a lineage
records.py     where each episode's fate is recorded (the trajectory store, JSON lines)
accounting.py  the run's closing account: every episode started has exactly one fate
"""

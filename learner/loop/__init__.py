"""Rank 0's learner loop, as named steps (learner/main.py starts it).

leader.py   the loop: receive episodes, step when a batch is ready, announce versions, finish
batches.py  which groups make the next batch (the buffer and the group filter)
session.py  where this learner session stands in the run, and what a checkpoint carries of it
report.py   each step's metrics record, its warnings and its progress line
finish.py   the run's closing summary: the accounts, the final checkpoint, summary.json
"""

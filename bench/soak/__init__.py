"""The soak: the real stack for an hour (or five minutes) under chaos and attack, watched for
leaks and lost episodes. `python -m millstream.bench.soak --help`; the parts:

__main__.py  the run, the attack, the report and its plot
watch.py     each role's memory and open descriptors over time, and their growth
"""

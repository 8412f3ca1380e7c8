"""What the benchmarks are built from.

rounds.py        interleaved rounds, spreads, the results folder, the record and its plot
procstat.py      CPU time of processes from /proc
replicas.py      synthetic actor replicas as processes
spawn.py         an engine process in its own group, in the benchmark's session
scratch.py       a scratch folder, removed when the benchmark ends well, kept when it fails
stress_report.py what `millstream stress` reports (also the turns/s window of pool_vs_http)
fleet_report.py  the fleet benchmark's plot and text
"""

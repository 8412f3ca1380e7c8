"""How a role process starts, is watched, and ends.

runtime.py     start-up and exit chores every role shares: arguments, config, logging, ports
cpus.py        which cores each role runs on, and how many threads its math starts
allocator.py   the memory allocator the actor's engine runs on (tcmalloc where there is one)
openmp.py      how the engine's OpenMP threads wait at their barriers (they sleep, on CPU)
enginecore.py  the EngineCore's busy loop yields to other threads (its priority, on CPU)
lifecycle.py   ending on a signal or with the launcher, with no child left behind
supervisor.py  the processes of one run: start them, watch them, say why one ended, stop all
"""

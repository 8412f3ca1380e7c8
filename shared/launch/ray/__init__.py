"""`launcher.kind = "ray"`: the run's roles as processes of Ray actors, on an existing cluster.

launch.py    the supervisor whose roles are Ray actors' processes
cluster.py   joining the cluster, and where each role may go
host.py      what runs on each node (`RoleHost`)
"""

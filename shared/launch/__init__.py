"""The operator's side: the `millstream` command and `millstream run`. No role imports this.

cli.py       the `millstream` command: one entry point per role, the launcher, the tools
launcher.py  `millstream run`: check a config, start and supervise every role
preflight.py what cannot succeed, found before any role starts (busy addresses, a run directory
             in use, an environment or LoRA target the roles would refuse)
healing.py   restart a role that died, within a budget (and, for testing, kill one now)
ray/         `launcher.kind = "ray"`: the roles placed and watched by Ray on a cluster
"""

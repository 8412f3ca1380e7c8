"""`launcher.kind = "ray"`: the run's roles placed and watched by Ray, on a cluster already running.

    ray start --head --node-ip-address 10.0.0.1 --port 6379      # once, on the head node
    ray start --address 10.0.0.1:6379                             # on every other node
    millstream run launcher.kind=ray launcher.ray_address=10.0.0.1:6379 ...

Ray does two things here, and only these: it places each role process on a node with the CPUs
and GPUs the config states for it, and it notices when the process that holds a role dies. The
data path is untouched: roles still meet at the ZeroMQ addresses of the config and broadcast
weights over gloo/NCCL. The launcher stays a plain process (Ray's driver) and imports no role.

How, and why:
- **One placement group for the roles started together**, one bundle per role process (its
  `launcher.<role>_cpus` and `_gpus`), reserved before any role starts (`starting()`): a run that
  does not fit fails at once, naming what it asked for and what the cluster has free, instead of
  starting half its roles; and a restarted role gets its own bundle back, so it never waits for
  resources something else took meanwhile. A role started later gets a group of its own.
- **Each role is a Ray actor** (`RoleHost`, shared/launch/ray/host.py) that starts `python -m
  millstream.<role>` as a child process on its node, in a session of its own, with the
  environment convention of shared/process/supervisor.py: `MILLSTREAM_PARENT_PID` is the Ray actor's
  process, so a role whose host died stops by itself (shared/process/lifecycle.py); `MILLSTREAM_RUN`,
  `MILLSTREAM_NAME`. Its log is `<run_dir>/logs/<name>.log` and the launcher writes
  `<run_dir>/<name>.pid` (the learner watches the actor's to notice a restart). The run
  directory must be on a filesystem every node mounts at the same path; so must `model.path` and
  `transport.keys_dir` (the run's CURVE keys).
- **Exits**: the launcher holds one `wait()` call per role; it returns the exit status, or fails
  when the Ray actor died (worker killed, node lost), which counts as the role dying (-9, "its Ray
  worker died"), so shared/launch/healing.py restarts it in a new Ray actor in the same bundle. That
  actor first kills what the dead one's role left behind on the node (its session).
- **Where roles may go follows the addresses they bind** (shared/launch/ray/cluster.py `node_pins`):
  each bundle asks for its node's `node:<ip>` resource. While any address is loopback (the
  default) that is the launcher's node for every role.
- **Nothing outlives the run**: `stop()` ends every role with what it started (SIGTERM, one grace
  for the whole group, children included, SIGKILL to what is left of its session; every node at
  once), kills the Ray actors and removes the placement groups. Should the launcher die outright, Ray
  ends the driver's actors and groups, and the roles see their parent gone.

Joining the cluster (bounded, with one-line errors) is shared/launch/ray/cluster.py; what runs on each
node is shared/launch/ray/host.py; running across hosts, and Slurm, is docs/multihost.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from millstream.shared.config import Config, ConfigError
from millstream.shared.launch.ray.cluster import connect, first_line, node_pins
from millstream.shared.launch.ray.host import Launch, RoleHost
from millstream.shared.process.runtime import exit_file
from millstream.shared.process.supervisor import LineStream, describe_exit, tail_log

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

__all__ = ["RaySupervisor", "RAY_WORKER_DIED"]

#: Exit code of a role whose Ray actor died.
RAY_WORKER_DIED = -9
#: Longest wait for a host to deliver a signal (a live one answers at once).
SIGNAL_TIMEOUT_S = 10.0


@dataclass
class _Role:
    """One start of a role: its Ray actor, the pending `wait()` call, where it runs."""

    host: Any  # ray.actor.ActorHandle of a RoleHost
    done: Any  # ray.ObjectRef of host.wait(); None if the start failed
    pid: int
    node: str


class RaySupervisor:
    """shared/process/supervisor.py's `Supervisor`, with every role a process of a Ray actor."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        connect(cfg)
        import ray

        self.cfg, self.run_dir = cfg, run_dir.resolve()
        self.timeout_s = cfg.launcher.ray_start_timeout_s
        self.procs: dict[str, _Role] = {}
        self.logs: dict[str, Path] = {}
        #: How each role was started, so `restart` can start it again.
        self.specs: dict[str, tuple[str, list[str], bool, dict[str, str] | None]] = {}
        self._pins = node_pins(cfg, ray.util.get_node_ip_address())
        self._bundles: dict[str, tuple[PlacementGroup, int]] = {}
        self._groups: list[PlacementGroup] = []
        self._pending: list[str] | None = None  # inside `starting()`
        self._codes: dict[str, int] = {}  # roles that ended, for their current start
        self._died: dict[str, str] = {}  # roles whose Ray actor died or failed to start, and how
        self._streams: list[_RemoteLines] = []  # `output()`s, read to their end before `stop`

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Roles started inside are reserved as one placement group, then started."""
        self._pending = []
        try:
            yield
            names = self._pending
        finally:
            self._pending = None
        self._reserve(names)
        self._launch(*names)

    def start(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        pipe_stdout: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.logs[name] = self.run_dir / "logs" / f"{name}.log"
        self.specs[name] = (module, args, pipe_stdout, env)
        if self._pending is not None:
            self._pending.append(name)
            return
        if name not in self._bundles:
            self._reserve([name])
        self._launch(name)

    def restart(self, name: str, extra_args: list[str] | None = None) -> None:
        """End what is left of `name` and its Ray actor; start it again in the same bundle."""
        self._end(self.procs[name])
        self._launch(name, extra_args=extra_args)

    def kill(self, name: str) -> None:
        """SIGKILL `name`'s whole session (fault injection); its Ray actor lives on."""
        self._call(self.procs[name].host.signal, signal.SIGKILL)

    def exited(self) -> dict[str, int]:
        import ray

        waiting = {role.done: name for name, role in self.procs.items() if name not in self._codes}
        if waiting:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
            for ref in ready:
                self._codes[waiting[ref]] = self._outcome(waiting[ref], ref)
        return dict(self._codes)

    def output(self, name: str) -> LineStream:
        self._streams.append(_RemoteLines(self.procs[name].host))
        return self._streams[-1]

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every role with everything it started, kill the Ray actors and remove the
        placement groups.

        Each host stops its role's whole group on its own node, all at once (`RoleHost.stop`:
        SIGTERM, up to `grace_s` for the group to empty, SIGKILL to what is left): a role's
        EngineCore still shutting down after the role exited gets its grace, as under the local
        launcher, and no process of the run is alive when this returns. Roles that exited
        before are stopped too, for the children they may have left."""
        import ray
        from ray.util.placement_group import remove_placement_group

        stops = [role.host.stop.remote(grace_s) for role in self.procs.values()]
        if stops:  # a host stops within grace_s + 10 s (stop_groups' wait after its SIGKILL)
            ray.wait(stops, num_returns=len(stops), timeout=grace_s + 10 + SIGNAL_TIMEOUT_S)
        left = [pid for ref in stops for pid in self._result(ref)]
        if left:  # stuck in the kernel: nothing more a signal can do; say so rather than hang
            print(f"millstream: processes {left} outlived SIGKILL", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 5  # the relay reads what the learner printed last
        for stream in self._streams:
            stream.ended.wait(max(0.0, deadline - time.monotonic()))
        for role in self.procs.values():
            self._end(role)
        for group in self._groups:
            remove_placement_group(group)
        self._groups.clear()

    def tail(self, name: str, lines: int = 15) -> str:
        return tail_log(self.logs[name], lines)

    def describe_exit(self, name: str, code: int) -> str:
        if name in self._died:
            return self._died[name]
        return describe_exit(self.run_dir, name, code, self.logs[name])

    # --- inside ------------------------------------------------------------------------------------

    def _bundle(self, name: str) -> dict[str, float]:
        kind = "actor" if name == "judge" else name.split("-")[0]  # the judge is an engine too
        launcher = self.cfg.launcher
        cpus, gpus = {
            "actor": (launcher.actor_cpus, launcher.actor_gpus),
            "learner": (launcher.learner_cpus, launcher.learner_gpus),
        }.get(kind, (launcher.envpool_cpus, 0.0))
        bundle = {"CPU": cpus, "GPU": gpus}
        pin = self._pins.get(name, self._pins.get(kind))  # a replica's own address first
        if pin is not None:
            bundle[f"node:{pin}"] = 0.001  # every node has 1 of its own `node:<ip>` resource
        return {k: v for k, v in bundle.items() if v}

    def _reserve(self, names: list[str]) -> None:
        """One placement group, one bundle per role; ConfigError if the cluster cannot hold it."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [self._bundle(n) for n in names]
        group = placement_group(bundles, strategy=self.cfg.launcher.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            asked = "; ".join(f"{n} {b}" for n, b in zip(names, bundles))
            raise ConfigError(
                f"launcher: the Ray cluster could not reserve the run's placement group in "
                f"{self.timeout_s:.0f}s (launcher.ray_start_timeout_s): it asks for {asked} "
                f"({self.cfg.launcher.placement_strategy}); free now: {ray.available_resources()}. "
                "Lower launcher.*_cpus/_gpus or add nodes"
            ) from None
        self._groups.append(group)
        self._bundles.update({n: (group, i) for i, n in enumerate(names)})

    def _launch(self, *names: str, extra_args: list[str] | None = None) -> None:
        """Start each role in a new Ray actor in its bundle, all at once (Ray starts the worker
        processes side by side); a start that fails counts as the role dying at once."""
        import ray

        calls = {}
        for name in names:
            job = self._job(name, extra_args or [])
            host = self._new_host(name)
            calls[name] = (host, host.start.remote(job))
        for name, (host, call) in calls.items():
            try:
                pid, node = ray.get(call, timeout=self.timeout_s)
            except ray.exceptions.RayError as exc:  # GetTimeoutError included
                ray.kill(host)  # healing restarts it or stops the run, saying why
                old = self.procs.get(name)  # whose leftovers the next start still kills
                self.procs[name] = _Role(host, None, old.pid if old else 0, old.node if old else "")
                self._codes[name] = RAY_WORKER_DIED
                self._died[name] = f"its Ray actor could not start it: {first_line(exc)}"
                continue
            self.procs[name] = _Role(host, host.wait.remote(), pid, node)
            (self.run_dir / f"{name}.pid").write_text(str(pid))

    def _job(self, name: str, extra_args: list[str]) -> Launch:
        """What `name`'s host needs to start it; forgets how its previous start ended."""
        module, args, pipe_stdout, env = self.specs[name]
        old = self.procs.get(name)
        exit_file(self.run_dir, name).unlink(missing_ok=True)  # a previous session's
        self._codes.pop(name, None)
        self._died.pop(name, None)
        return Launch(
            name=name,
            module=module,
            args=[*args, *extra_args],
            env=env or {},
            run_dir=str(self.run_dir),
            cwd=os.getcwd(),
            pipe_stdout=pipe_stdout,
            leftover=(old.node, old.pid) if old else None,
        )

    def _new_host(self, name: str) -> Any:
        """A RoleHost actor in `name`'s bundle, asking for the bundle's CPUs and GPUs."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, index = self._bundles[name]
        bundle = self._bundle(name)
        options = ray.remote(RoleHost).options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=4,  # wait() holds one thread for the role's life
            max_restarts=0,  # healing restarts roles, not Ray
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
        )
        return options.remote()

    def _outcome(self, name: str, ref: Any) -> int:
        import ray

        try:
            return int(ray.get(ref, timeout=SIGNAL_TIMEOUT_S))  # ready: no wait
        except ray.exceptions.RayError as exc:
            self._died[name] = f"its Ray worker died: {first_line(exc)}"
            return RAY_WORKER_DIED

    def _end(self, role: _Role) -> None:
        """SIGKILL the role's session, then its Ray actor."""
        import ray

        self._call(role.host.signal, signal.SIGKILL)
        ray.kill(role.host)

    @staticmethod
    def _result(ref: Any) -> list[int]:
        """What a host's `stop` returned; nothing if the host is gone (its role with it) or has
        not answered in time."""
        import ray

        try:
            return list(ray.get(ref, timeout=0))
        except (ray.exceptions.RayError, TimeoutError):
            return []

    def _call(self, method: Any, *args: Any) -> None:
        """A call to a host that may be dead already (then there is nothing to do)."""
        import ray

        try:
            ray.get(method.remote(*args), timeout=SIGNAL_TIMEOUT_S)
        except ray.exceptions.RayError:
            pass


class _RemoteLines:
    """A role's stdout, read from its host in batches (the launcher relays the learner's)."""

    def __init__(self, host: Any) -> None:
        self._host = host
        self._buffer: deque[bytes] = deque()
        self._next = 0
        self._ended = False
        #: Set once the stream ended (every line read, or the host gone).
        self.ended = threading.Event()

    def readline(self) -> bytes:
        import ray

        while not self._buffer and not self._ended:
            try:
                lines: list[bytes]
                lines, self._next, self._ended = ray.get(self._host.read.remote(self._next, 1.0), timeout=30)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:  # the host is gone: so is the role's output
                self._ended = True
                break
            self._buffer.extend(lines)
        if not self._buffer:
            self.ended.set()
            return b""
        return self._buffer.popleft()

"""The run's CURVE keys: who may talk to the run's sockets, and who may attach as its learner.

Every ZeroMQ socket of a run is encrypted and authenticated with CURVE (libzmq's built-in
elliptic-curve security) unless `transport.curve = false`, which config allows only when every
address is loopback or ipc. The keys live in one folder, by default `<run.dir>/keys`:

    server.key / server.key_secret           every socket that binds (actor, learner) serves with it
    learner.key / learner.key_secret         the learner's client key (its link to the actor)
    envpool-<i>.key / envpool-<i>.key_secret envpool worker i's own client key
    envpool.key / envpool.key_secret         the envpool's tools (repl, replay, benchmarks): they
                                             may generate, but speak for no worker
    actor.key / actor.key_secret             the actor's client key (for roles that connect out)

The files are pyzmq's certificate format (`zmq.auth.load_certificate` reads them); the folder is
0700 and every file 0600, so only the run's own user can read a secret. `ensure_keys` creates
the folder once, atomically (a temporary folder renamed into place), so the launcher and roles
started by hand with the same `transport.keys_dir` never race into two different sets.

A binding socket admits a peer only if its public key is one of the run's client keys: each
binding process runs a ZAP authenticator (`zmq.auth.thread.ThreadAuthenticator`, one per
process) that checks the key and names the peer by role. The name reaches the application as the
message's `User-Id` property, so the actor can take `AttachLearner` from the learner's key only,
whatever else holds the envpool's key.

One key per envpool worker: the learner takes worker i's bookkeeping (`WorkerHello`,
`GroupStarted`, `PoolDone`, `EvalResult`) and episodes of the groups worker i started only from worker i's
key (learner/episodes/intake.py). With one key for all workers, any holder could say hello as
worker 0 with a new incarnation and make the learner write off worker 0's live episodes, or
fail another worker's episodes before they ran. Worker keys are made for `envpool.workers`
workers, more when a run grows (each file is made once: the first process to link it in wins).
The launcher and the binding roles make every worker's key; a worker makes at most its own. A
host that only runs workers needs `server.key` (public) and its own workers' pairs, nothing
else. What this guards against is one leaked key; a worker process that runs as the run's user
on a machine holding the whole folder can read every secret in it.

What this does not do: separate the roles from each other. Every role reads the one folder (a
binding role needs the server's secret, and all run as one user), so a process that runs as the
run's user, or as root, can read every key; the role check keeps a peer holding only the
envpool's key from attaching, not such a process. And the TCPStores of the weight broadcast and
of DeepSpeed have no authentication at all: they listen on the configured host only (loopback
by default), so they are open to the processes of this machine.

Why one server key for all binding sockets rather than one per role: a role's client then needs
one public key, whatever it connects to, and the trust is the same, the run's own processes.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from millstream.shared.config import Config, ConfigError

__all__ = [
    "RunKeys",
    "clients",
    "ensure_keys",
    "keys_dir",
    "load_keys",
    "secure",
    "stop_authenticator",
    "worker_of",
    "worker_role",
    "CLIENT_ROLES",
]

#: The ZAP domain of a run's binding sockets.
ZAP_DOMAIN = "millstream"

#: The client identities of a run; the actor takes weights only from "learner".
CLIENT_ROLES = ("learner", "envpool", "actor")
_ALL = ("server", *CLIENT_ROLES)


@dataclass(frozen=True)
class RunKeys:
    """What one process needs: the server's key pair and its own client key pair."""

    folder: Path
    role: str  #: whose client key this process uses ("envpool-3" for worker 3)
    server_public: bytes
    #: None where the folder holds only the server's public key (a host of clients only)
    server_secret: bytes | None
    public: bytes
    secret: bytes
    #: public key (z85) -> role, for every client of the run
    clients: dict[bytes, str]


def keys_dir(cfg: Config) -> Path:
    """Where this run's keys are: `transport.keys_dir`, else `<run.dir>/keys`."""
    if cfg.transport.keys_dir:
        return Path(cfg.transport.keys_dir)
    if cfg.run.dir:
        return Path(cfg.run.dir) / "keys"
    raise ConfigError(
        "transport.keys_dir: CURVE authentication (transport.curve = true) needs the run's keys; "
        "set run.dir or transport.keys_dir (a role started by hand for a run: <run.dir>/keys), "
        "or transport.curve=false for a run on loopback only"
    )


def worker_role(index: int) -> str:
    """The client identity of envpool worker `index`."""
    return f"envpool-{index}"


_WORKER = re.compile(r"envpool-(0|[1-9][0-9]{0,5})")


def worker_of(role: str | None) -> int | None:
    """The worker index an identity belongs to ("envpool-3" -> 3), None for any other."""
    match = _WORKER.fullmatch(role) if role is not None else None
    return int(match.group(1)) if match else None


def ensure_keys(folder: str | Path, workers: int = 0) -> Path:
    """Create the key folder if it is missing (atomically) and worker keys 0..workers-1 if
    they are; return it. The launcher and the binding roles make every worker's; a worker makes
    at most its own (`load_keys`)."""
    folder = _ensure_folder(Path(folder))
    for index in range(workers):
        _ensure_pair(folder, worker_role(index))
    return folder


def _ensure_pair(folder: Path, name: str) -> None:
    """Make `name`'s key pair in `folder` unless it exists. The secret file (which holds both
    keys) is put in place only if none is there (a hard link, or an exclusive create where the
    file system has no links), so of processes racing only the first one's pair is kept; the
    public file is then written from it (same bytes whoever writes it)."""
    secret, public = folder / f"{name}.key_secret", folder / f"{name}.key"
    if not secret.exists():
        # A public key copied here without its secret is not ours to remake. (Secret looked at
        # again: a racing process puts its secret in place before it writes the public file.)
        if public.exists() and not secret.exists():
            raise ConfigError(f"{public} has no {secret.name} beside it: copy the pair, or neither")
        with tempfile.TemporaryDirectory(prefix=".key-", dir=folder) as staging:
            _, made = zmq.auth.create_certificates(staging, name)
            os.chmod(made, 0o600)
            _place_once(Path(made), secret)
    if not public.exists():
        public_key, _ = zmq.auth.load_certificate(secret)
        with tempfile.TemporaryDirectory(prefix=".key-", dir=folder) as staging:
            path = Path(staging) / public.name
            path.write_text(f'metadata\ncurve\n    public-key = "{public_key.decode()}"\n')
            os.chmod(path, 0o600)
            os.replace(path, public)


def _place_once(made: Path, target: Path) -> None:
    """Put `made` at `target` unless a file is there already (then keep that one)."""
    try:
        os.link(made, target)
        return
    except FileExistsError:
        return
    except OSError:  # no hard links here (SMB, some FUSE): an exclusive create instead
        pass
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:  # a reader of a half-written file retries below, in load
        f.write(made.read_bytes())


def _ensure_folder(folder: Path) -> Path:
    if (folder / "server.key").exists():  # a host of clients may hold the public key only
        _check_private(folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".keys-", dir=folder.parent))  # mode 0700
    for name in _ALL:
        public, secret = zmq.auth.create_certificates(staging, name)
        os.chmod(public, 0o600)
        os.chmod(secret, 0o600)
    try:
        os.rename(staging, folder)
    except OSError:  # someone else made it first (or an empty folder is in the way)
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "server.key").exists():
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
                return ensure_keys(folder)
            raise ConfigError(
                f"transport.keys_dir = {str(folder)!r}: exists but holds no server key"
            ) from None
    _check_private(folder)
    return folder


def load_keys(cfg: Config, role: str, worker: int | None = None) -> RunKeys | None:
    """The keys `role` uses in this run, creating the folder if needed; None if CURVE is off.
    An envpool worker passes its index and gets its own key (`worker_role`)."""
    if not cfg.transport.curve:
        return None
    if role not in CLIENT_ROLES:
        raise ValueError(f"role must be one of {CLIENT_ROLES}, got {role!r}")
    workers = cfg.envpool.workers
    if worker is not None and not (role == "envpool" and 0 <= worker < workers):
        raise ValueError(
            f"{role} worker {worker} has no key: keys are made for envpool workers 0..{workers - 1} "
            f"(envpool.workers = {workers})"
        )
    own = worker_role(worker) if worker is not None else role
    # The binding roles (and the tools, which make nothing beyond the folder) make every
    # worker's key; a worker only its own, so a host of workers holds no other worker's secret.
    folder = ensure_keys(keys_dir(cfg), workers if role in ("actor", "learner") else 0)
    if worker is not None:
        _ensure_pair(folder, own)
    server_public, server_secret = _load_pair(folder, "server", need_secret=False)
    public, secret = _load_pair(folder, own, need_secret=True)
    assert secret is not None
    return RunKeys(folder, own, server_public, server_secret, public, secret, clients(folder))


def _load_pair(folder: Path, name: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    """`name`'s keys from `folder` (its secret file if there, else its public one)."""
    path = folder / f"{name}.key_secret"
    if not path.exists() and not need_secret:
        path = folder / f"{name}.key"
    public, secret = zmq.auth.load_certificate(path)
    own_public = folder / f"{name}.key"
    if own_public.exists() and zmq.auth.load_certificate(own_public)[0] != public:
        raise ConfigError(f"{own_public} does not match {path.name}: the pair was copied from two sets")
    return public, secret


def clients(folder: Path) -> dict[bytes, str]:
    """Every client's public key in `folder` -> its identity (the roles', each worker's); a
    host of clients may lack some (it admits nobody: only binding roles read this)."""
    names = [*CLIENT_ROLES, *(p.stem for p in folder.glob("envpool-*.key") if worker_of(p.stem) is not None)]
    found = {}
    for name in names:
        try:
            found[zmq.auth.load_certificate(folder / f"{name}.key")[0]] = name
        except (OSError, ValueError):  # missing here, or being written by a racing process
            continue
    return found


def _check_private(folder: Path) -> None:
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"transport.keys_dir = {str(folder)!r}: mode {mode:o} lets other users read the run's "
            f"secret keys; chmod 700 it"
        )


# --- sockets ----------------------------------------------------------------------------------


class _RunAuthenticator(ThreadAuthenticator):
    """Admits the run's client keys and names each peer by role (the `User-Id` property)."""

    def __init__(self, context: zmq.Context, clients: dict[bytes, str], server_public: bytes) -> None:
        super().__init__(context)
        self.clients, self.server_public = clients, server_public

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.clients.get(zmq.utils.z85.encode(client_public_key), "unknown")


class _Admit:
    """pyzmq's credentials provider: `callback(domain, z85_key)` says whether to admit.

    An unknown key makes it read the folder again if the folder changed since it last did (a
    `stat`): a worker key made after this process loaded the keys (a later run with more
    workers against an actor that stays up) is admitted at its first handshake, which matters
    because a client that ZAP denied does not try again; a flood of unknown keys costs a stat
    each."""

    def __init__(self, known: dict[bytes, str], folder: Path) -> None:
        self.clients, self.folder = known, folder
        self._seen = self._stamp()

    def _stamp(self) -> int:
        try:
            return self.folder.stat().st_mtime_ns
        except OSError:
            return -1

    def callback(self, domain: str, key: bytes) -> bool:
        if key not in self.clients and (stamp := self._stamp()) != self._seen:
            self._seen = stamp
            self.clients.update(clients(self.folder))  # the same dict the naming reads
        return key in self.clients


_auth_lock = threading.Lock()
_authenticators: dict[int, _RunAuthenticator] = {}


def _authenticator(context: zmq.Context, keys: RunKeys) -> None:
    """Start this process's ZAP handler once per context (a binding socket needs it)."""
    with _auth_lock:
        auth = _authenticators.get(id(context))
        if auth is not None:
            if auth.server_public != keys.server_public:
                raise RuntimeError("one process serves two runs' keys; use one set per process")
            auth.clients.update(keys.clients)  # a later load may know more workers (shared dict)
            return
        known = dict(keys.clients)  # one dict, read by both the admission and the naming
        auth = _RunAuthenticator(context, known, keys.server_public)
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Admit(known, keys.folder))
        _authenticators[id(context)] = auth


def stop_authenticator(context: zmq.Context) -> None:
    """Stop the ZAP handler of `context`, if it has one (before `context.term()`, which would
    otherwise wait for the handler's sockets)."""
    with _auth_lock:
        auth = _authenticators.pop(id(context), None)
    if auth is not None:
        auth.stop()


def secure(sock: zmq.Socket, keys: RunKeys | None, *, bind: bool) -> None:
    """Make `sock` a CURVE server (bind) or client (connect) of the run; before bind/connect."""
    if keys is None:
        return
    if bind:
        if keys.server_secret is None:
            raise ConfigError(
                f"{keys.folder} holds no server.key_secret: this host cannot bind the run's sockets"
            )
        _authenticator(sock.context, keys)
        # With a domain enforced, a missing ZAP handler refuses every peer (without, libzmq
        # would admit any client that knows the server's public key).
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
    else:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.server_public

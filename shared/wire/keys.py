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
`GroupStarted`, `PoolDone`) and episodes of the groups worker i started only from worker i's
key (learner/episodes/intake.py). With one key for all workers, any holder could say hello as
worker 0 with a new incarnation and make the learner write off worker 0's live episodes, or
fail another worker's episodes before they ran. Worker keys are made for `envpool.workers`
workers, more when a run grows (each file is made once: the first process to link it in wins).
On many hosts each host needs only its own workers' secrets, the server's and the public keys.

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
    "ensure_keys",
    "keys_dir",
    "load_keys",
    "secure",
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
    server_secret: bytes
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


def worker_of(role: str | None) -> int | None:
    """The worker index an identity belongs to ("envpool-3" -> 3), None for any other."""
    if role is None or not role.startswith("envpool-"):
        return None
    number = role[len("envpool-") :]
    return int(number) if number.isdigit() else None


def ensure_keys(folder: str | Path, workers: int = 0) -> Path:
    """Create the key folder if it is missing (atomically) and worker keys 0..workers-1 if
    they are; return it."""
    folder = _ensure_folder(Path(folder))
    for index in range(workers):
        _ensure_pair(folder, worker_role(index))
    return folder


def _ensure_pair(folder: Path, name: str) -> None:
    """Make `name`'s key pair in `folder` unless it exists. The secret file (which holds both
    keys) is linked into place, so of processes racing only the first one's pair is kept; the
    public file is then written from it (same bytes whoever writes it)."""
    secret = folder / f"{name}.key_secret"
    if not secret.exists():
        with tempfile.TemporaryDirectory(prefix=".key-", dir=folder) as staging:
            _, made = zmq.auth.create_certificates(staging, name)
            os.chmod(made, 0o600)
            try:
                os.link(made, secret)
            except FileExistsError:
                pass
    public = folder / f"{name}.key"
    if not public.exists():
        public_key, _ = zmq.auth.load_certificate(secret)
        with tempfile.TemporaryDirectory(prefix=".key-", dir=folder) as staging:
            path = Path(staging) / public.name
            path.write_text(f'metadata\ncurve\n    public-key = "{public_key.decode()}"\n')
            os.chmod(path, 0o600)
            os.replace(path, public)


def _ensure_folder(folder: Path) -> Path:
    if (folder / "server.key_secret").exists():
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
        if not (folder / "server.key_secret").exists():
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
    folder = ensure_keys(keys_dir(cfg), workers)
    own = worker_role(worker) if worker is not None else role
    server_public, server_secret = zmq.auth.load_certificate(folder / "server.key_secret")
    public, secret = zmq.auth.load_certificate(folder / f"{own}.key_secret")
    assert server_secret is not None and secret is not None
    return RunKeys(folder, own, server_public, server_secret, public, secret, _clients(folder))


def _clients(folder: Path) -> dict[bytes, str]:
    """Every client's public key in `folder` -> its identity (the roles', each worker's)."""
    names = list(CLIENT_ROLES)
    names += sorted(
        p.name[: -len(".key")] for p in folder.glob("envpool-*.key") if worker_of(p.stem) is not None
    )
    return {zmq.auth.load_certificate(folder / f"{name}.key")[0]: name for name in names}


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
    """pyzmq's credentials provider: `callback(domain, z85_key)` says whether to admit."""

    def __init__(self, clients: dict[bytes, str]) -> None:
        self.clients = clients

    def callback(self, domain: str, key: bytes) -> bool:
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
        clients = dict(keys.clients)  # one dict, read by both the admission and the naming
        auth = _RunAuthenticator(context, clients, keys.server_public)
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_Admit(clients))
        _authenticators[id(context)] = auth


def secure(sock: zmq.Socket, keys: RunKeys | None, *, bind: bool) -> None:
    """Make `sock` a CURVE server (bind) or client (connect) of the run; before bind/connect."""
    if keys is None:
        return
    if bind:
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

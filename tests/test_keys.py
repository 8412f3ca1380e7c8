"""The run's CURVE keys (shared/wire/keys.py): private files, one set however many roles race to make
them, and the loopback-only opt-out."""

import os
import stat
import subprocess
import sys

import pytest
import zmq.auth

from millstream.shared.config import Config, ConfigError, RunConfig, TransportConfig, load_config
from millstream.shared.wire.keys import (
    CLIENT_ROLES,
    ensure_keys,
    keys_dir,
    load_keys,
    secure,
    stop_authenticator,
)


def test_keys_are_private_and_name_every_role(tmp_path):
    folder = ensure_keys(tmp_path / "keys")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(f"{n}{ext}" for n in ("server", *CLIENT_ROLES) for ext in (".key", ".key_secret"))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    keys = load_keys(Config(run=RunConfig(dir=str(tmp_path))), "learner")
    assert keys is not None and keys.folder == folder
    assert keys.clients[keys.public] == "learner"  # and every client, envpool worker 0 among them
    assert set(keys.clients.values()) == {*CLIENT_ROLES, "envpool-0"}
    assert keys.public != keys.server_public


def test_each_envpool_worker_has_a_key_of_its_own(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}", "envpool.workers=3"])
    mine = [load_keys(cfg, "envpool", worker=i) for i in range(3)]
    assert [k.role for k in mine if k] == ["envpool-0", "envpool-1", "envpool-2"]
    assert (
        len({k.secret for k in mine if k}) == 3 and mine[0] and mine[0].clients[mine[0].public] == "envpool-0"
    )
    tools = load_keys(cfg, "envpool")  # the repl's, the benchmarks': no worker's
    assert tools and tools.role == "envpool" and tools.public not in {k.public for k in mine if k}
    with pytest.raises(ValueError, match=r"envpool worker 3 has no key: .* \(envpool.workers = 3\)"):
        load_keys(cfg, "envpool", worker=3)
    # A run resumed with more workers gets their keys; the others stay what they were.
    more = load_keys(load_config(None, [f"run.dir={tmp_path}", "envpool.workers=5"]), "envpool", worker=4)
    assert more and more.role == "envpool-4" and more.clients[mine[2].public] == "envpool-2"
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (tmp_path / "keys").iterdir())


def racing(script: str, folder, count: int) -> set[str]:
    """What `count` processes running `script` on `folder` at once printed (each succeeded)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    outputs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    return outputs


def test_processes_racing_to_make_a_worker_key_agree_on_one(tmp_path):
    folder = ensure_keys(tmp_path / "keys")
    script = (
        "import sys, zmq.auth; from millstream.shared.wire.keys import ensure_keys; "
        "f = ensure_keys(sys.argv[1], 4); "
        "print(*(zmq.auth.load_certificate(f / f'envpool-{i}.key_secret')[1].decode() for i in range(4)))"
    )
    assert len(racing(script, folder, 6)) == 1
    for i in range(4):  # the public file matches the secret that won
        public = zmq.auth.load_certificate(folder / f"envpool-{i}.key")[0]
        assert public == zmq.auth.load_certificate(folder / f"envpool-{i}.key_secret")[0]
    assert not [p for p in folder.iterdir() if p.name.startswith(".key-")]  # no staging left


def test_roles_racing_to_make_the_keys_agree_on_one_set(tmp_path):
    """Eight processes create the same folder at once; every one then reads the same server key."""
    folder = tmp_path / "keys"
    script = (
        "import sys, zmq.auth; from millstream.shared.wire.keys import ensure_keys; "
        "f = ensure_keys(sys.argv[1]); print(zmq.auth.load_certificate(f / 'server.key')[0].decode())"
    )
    outputs = racing(script, folder, 8)
    assert len(outputs) == 1 and len(outputs.pop()) == 40
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keys-")]  # no staging left


def test_a_folder_others_can_read_is_refused(tmp_path):
    folder = ensure_keys(tmp_path / "keys")
    os.chmod(folder, 0o755)
    with pytest.raises(ConfigError, match="lets other users read the run's secret keys"):
        ensure_keys(folder)


def test_keys_need_a_place_unless_curve_is_off():
    with pytest.raises(ConfigError, match="transport.keys_dir"):
        keys_dir(Config())
    assert load_keys(Config(transport=TransportConfig(curve=False)), "envpool") is None


def test_curve_off_only_on_loopback():
    ok = load_config(None, ["transport.curve=false", "actor.address=tcp://127.0.0.1:0"])
    assert not ok.transport.curve
    load_config(None, ["transport.curve=false", "learner.experience_address=ipc:///tmp/x"])
    with pytest.raises(ConfigError, match=r"transport.curve = false: actor.connect = .*not a loopback"):
        load_config(None, ["transport.curve=false", "actor.connect=tcp://10.1.2.3:5555"])
    with pytest.raises(ConfigError, match="learner.version_address"):
        load_config(None, ["transport.curve=false", "learner.version_address=tcp://*:5556"])
    with pytest.raises(ConfigError, match="actor.connect"):  # a name, not a loopback address
        load_config(None, ["transport.curve=false", "actor.connect=tcp://127.evil.example:5555"])
    load_config(None, ["actor.connect=tcp://10.1.2.3:5555"])  # with CURVE, any address


def test_a_worker_makes_its_own_key_only_and_a_host_of_clients_needs_no_server_secret(tmp_path):
    folder = tmp_path / "keys"
    cfg = load_config(None, [f"transport.keys_dir={folder}", "envpool.workers=3"])
    mine = load_keys(cfg, "envpool", worker=1)
    assert mine and not (folder / "envpool-0.key_secret").exists()  # not another worker's
    assert (folder / "envpool-1.key_secret").exists()
    # A host of workers 1 only: the server's public key and worker 1's pair, copied.
    host = tmp_path / "host"
    host.mkdir(mode=0o700)
    for name in ("server.key", "envpool-1.key", "envpool-1.key_secret"):
        (host / name).write_bytes((folder / name).read_bytes())
    there = load_keys(
        load_config(None, [f"transport.keys_dir={host}", "envpool.workers=3"]), "envpool", worker=1
    )
    assert there and there.secret == mine.secret and there.server_secret is None
    assert sorted(p.name for p in host.iterdir()) == ["envpool-1.key", "envpool-1.key_secret", "server.key"]
    with pytest.raises(ConfigError, match="holds no server.key_secret"):
        secure(zmq.Context.instance().socket(zmq.PULL), there, bind=True)
    # A public key copied without its secret is not silently replaced by a new pair.
    (host / "envpool-2.key").write_bytes((folder / "envpool-1.key").read_bytes())
    with pytest.raises(ConfigError, match="envpool-2.key has no envpool-2.key_secret"):
        load_keys(load_config(None, [f"transport.keys_dir={host}", "envpool.workers=3"]), "envpool", worker=2)


def test_a_binding_process_admits_a_worker_key_made_after_it_started(tmp_path):
    """An actor that stays up across runs (actor.connect) loaded the keys when one worker had
    any; a later run with two makes envpool-1's, and the actor admits it."""
    folder = tmp_path / "keys"
    one = load_config(None, [f"transport.keys_dir={folder}", "envpool.workers=1"])
    server_keys = load_keys(one, "actor")
    ctx = zmq.Context()  # its own: the process's authenticator is per context
    try:
        pull = ctx.socket(zmq.PULL)
        secure(pull, server_keys, bind=True)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        worker = load_keys(
            load_config(None, [f"transport.keys_dir={folder}", "envpool.workers=2"]), "envpool", worker=1
        )
        push = ctx.socket(zmq.PUSH)
        secure(push, worker, bind=False)
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"hello")
        assert pull.poll(5000), "the new worker's key was never admitted"
        frame = pull.recv(copy=False)
        assert frame.bytes == b"hello" and frame.get("User-Id") == "envpool-1"
        push.close(0)
        pull.close(0)
    finally:
        stop_authenticator(ctx)
        ctx.destroy(linger=0)

"""A run's sockets admit the run's own processes only (CURVE, shared/wire/keys.py), checked against a
live `millstream run`: a forged experience message and a forged attach from a process without
the run's keys change nothing, a process holding the envpool's key still cannot attach as the
learner, and nothing the run started listens beyond loopback.

The run uses the synthetic actor (the weights path and the learner are real; vLLM adds nothing
to what is checked here), a data-parallel learner of two ranks (so the DeepSpeed group's store
is checked too) and keys of its own in `<run.dir>/keys`.
"""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
import zmq
from helpers import check_accounting, read_episodes, start_run

from millstream.learner.sync.weights import WeightSender, WeightSyncError
from millstream.shared.config import Config, LearnerConfig, RunConfig
from millstream.shared.process.lifecycle import run_processes
from millstream.shared.wire import AttachLearner, Codec, ErrorReply, Hello, Trajectory
from millstream.shared.wire.keys import load_keys, secure

FORGED_REWARD = 1e9


def _forged_group(size: int) -> list[Trajectory]:
    return [
        Trajectory(
            f"forged-{i}", "g999999", 1, "echo", [1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], [-1, 0, 0],
            FORGED_REWARD, [FORGED_REWARD], 1, size, 0.1,
        )
        for i in range(size)
    ]  # fmt: skip


def _push_unkeyed(address: str, messages: list) -> None:
    """What any local process can do: connect and push, without the run's keys."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 500)
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # once the refused handshake dropped the pipe, send blocks
    sock.connect(address)
    try:
        sock.send(Codec().encode(messages))
    except zmq.Again:
        pass  # refused before anything was queued: the same outcome
    sock.close()


def _attach_with_envpool_key(address: str, keys) -> object:
    """A peer holding the envpool's key (the run's, but not the learner's) asks to attach."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure(sock, keys, bind=False)
    sock.connect(address)
    codec = Codec()
    sock.send(codec.encode([Hello("intruder")]))
    assert sock.poll(20_000), "the actor did not answer Hello"
    codec.decode(sock.recv())
    sock.send(codec.encode([AttachLearner("intruder", "127.0.0.1", 1, 2, "gloo", 5.0)]))
    assert sock.poll(20_000), "the actor did not answer the attach"
    (reply,) = codec.decode(sock.recv())
    sock.close()
    return reply


def _listeners(pids: list[int]) -> list[str]:
    """Local addresses of the TCP listeners the given processes hold (`ss -ltnp`)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    wanted = {str(p) for p in pids}
    return [line.split()[3] for line in out.splitlines() if wanted & set(re.findall(r"pid=(\d+)", line))]


@pytest.mark.real
def test_a_run_admits_only_its_own_keys(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        'transport.keys_dir=""',  # this run's own keys, in run_dir/keys
        "actor.kind=synthetic",
        f"model.path={tiny_model_dir}",
        "train.steps=60",
        "train.group_size=4",
        "learner.ranks=2",  # the data-parallel group's store too
        until="step    2/",
    )
    resolved = tomllib.loads((run_dir / "config.toml").read_text())
    assert resolved["transport"]["keys_dir"] == str((run_dir / "keys").resolve())
    cfg = Config(run=RunConfig(dir=str(run_dir)))

    listeners = _listeners(run_processes(run_dir))
    assert listeners and all(a.startswith("127.0.0.1:") for a in listeners), listeners

    _push_unkeyed(resolved["learner"]["experience_address"], _forged_group(4))
    outsider = WeightSender(
        resolved["actor"]["address"], LearnerConfig(sync_timeout_s=3), dtype="float32", keys=None
    )
    try:
        outsider.attach()
        raise AssertionError("an attach without the run's keys was answered")
    except WeightSyncError as exc:
        # The handshake never completes: silence, whether the Hello found no connection to
        # take it (the actor dropped the keyless one) or went out and was never answered.
        assert "no ActorInfo" in str(exc) or "no connection to the replica" in str(exc), exc
    finally:
        outsider.close()
    reply = _attach_with_envpool_key(resolved["actor"]["address"], load_keys(cfg, "envpool"))
    assert isinstance(reply, ErrorReply) and reply.cause == "not_learner"

    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    check_accounting(run_dir)
    records = read_episodes(run_dir)
    assert records and not [r for r in records if str(r.get("episode_id", "")).startswith("forged")]
    assert max(r["reward"] for r in records if r["reward"] is not None) < FORGED_REWARD
    assert "learner session intruder" not in (run_dir / "logs" / "actor.log").read_text()

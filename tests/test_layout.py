"""The architecture (docs/architecture.md): its import rules and its map of the modules."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).parents[1] / "specli"
CORE = ["engine.py", "generate.py", "loadable.py", "verify.py", "stats.py", "config.py",
        "pairing.py", "headmeta.py", "headconvert.py", "headckpt.py", "ggufmeta.py",
        "tuning.py", "cost.py", "toolcall.py", "toolgrammar.py", "toolstream.py",
        "errors.py", "audit", "backend", "batching.py", "chat.py", "defaults.py", "drafts",
        "grammar_host.py", "plan.py", "prompt.py", "meter.py", "rules.py", "template_host.py",
        "child.py"]


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def core_files():
    for entry in CORE:
        p = PKG / entry
        yield from (sorted(p.glob("*.py")) if p.is_dir() else [p])


def test_only_backend_imports_llama_cpp():
    users = {p.relative_to(PKG).parts[0] for p in PKG.rglob("*.py") if any(
        n == "llama_cpp" or n.startswith("llama_cpp.") for n in imports(p))}
    assert users == {"backend"}


def test_the_core_never_imports_the_faces():
    for p in core_files():
        bad = {n for n in imports(p) if n.split(".")[0] in {"typer", "rich", "fastapi"}
               or n.startswith(("specli.cli", "specli.server"))}
        assert not bad, f"{p.name} imports {bad}"


def test_only_hub_imports_huggingface_hub():
    """hub.py is the one module that may open a network connection (design.md)."""
    users = {p.name for p in PKG.rglob("*.py") if any(
        n.split(".")[0] == "huggingface_hub" for n in imports(p))}
    assert users == {"hub.py"}


def test_the_audit_recorder_is_self_contained():
    """Python children import it as their sitecustomize: it may need only the standard
    library (a child may be another interpreter, without specli)."""
    import sys

    for name in ("sitecustomize.py", "boot.py"):  # boot.py runs before site-packages exist
        names = imports(PKG / "audit" / "_site" / name)
        assert {n.split(".")[0] for n in names} - {"__future__"} <= \
            set(sys.stdlib_module_names), name


def test_the_audit_is_a_wing_of_its_own():
    """specli/audit/ has nothing to do with speculation: only `specli audit`'s command
    imports it, and it imports nothing of the engine's."""
    users = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
             if not p.is_relative_to(PKG / "audit")
             and any(n.startswith("specli.audit") for n in imports(p))}
    assert users == {"cli/audit.py", "cli/audit_boot.py"}, users
    for p in (PKG / "audit").rglob("*.py"):
        outside = {n for n in imports(p) if n.startswith("specli.")
                   and not n.startswith("specli.audit")} - {"specli.errors"}
        assert not outside, f"{p.relative_to(PKG)} imports {outside}"


def test_importing_specli_loads_nothing_native():
    """`import specli` (and the modules that need no model) work without llama.cpp: the
    entry point decides what a process loads (specli/__main__.py), the package does not."""
    import subprocess
    import sys

    code = ("import importlib.abc, sys\n"
            "class Deny(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('llama_cpp', 'gguf'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Deny())\n"
            "import specli, specli.toolcall, specli.chat, specli.config, specli.audit.auditor\n"
            "print(sorted(m for m in sys.modules if m.startswith(('llama_cpp', 'gguf'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


DOC = Path(__file__).parents[1] / "docs" / "architecture.md"


def test_every_module_is_on_the_map():
    """docs/architecture.md names every module (a package's under the package's name)."""
    doc = DOC.read_text()
    missing = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG)
        if p.name == "__init__.py" and len(rel.parts) > 1:
            continue
        if f"`{p.name}`" not in doc or len(rel.parts) > 1 and f"`{rel.parts[0]}/`" not in doc:
            missing.append(str(rel))
    assert not missing, f"not in docs/architecture.md: {missing}"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if p.name == "__init__.py" else parts)] = p
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the specli modules it imports (type-only imports too). A package stands
    for the modules its __init__ imports (its face); a package's face is no node itself."""
    faces = {m for m, p in mods.items() if p.name == "__init__.py"}

    def targets(name: str) -> set[str]:
        return set(expand(name)) if name in mods else set()

    def expand(name: str, seen: frozenset = frozenset()) -> set[str]:
        if name not in faces or name == "specli":
            return {name} - faces
        out: set[str] = set()
        for t in raw(name):
            if t not in seen and t.startswith(name + "."):
                out |= expand(t, seen | {name})
        return out

    def raw(name: str) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(mods[name].read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("specli")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specli"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if sub in mods else node.module)
        return found

    return {m: set().union(*(targets(t) for t in raw(m))) - {m} for m in mods if m not in faces}


def test_no_import_circle():
    """No two modules import each other, directly or around a loop, not even for a type."""
    graph = _edges(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(
                    [*path[path.index(n):], n] if n in path else [m, n]))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert graph["specli.engine"], "the graph must hold the imports for this to test anything"


def test_the_scripts_import_what_exists():
    """scripts/ (benchmarks, recipes) import specli's names: a name moved is caught here,
    not by the next person who runs a benchmark."""
    import importlib

    missing = []
    for path in sorted((PKG.parent / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specli"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and importlib.util.find_spec(
                            f"{node.module}.{alias.name}") is None:
                        missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert not missing, missing


def test_no_module_over_800_lines():
    """A module a newcomer can read through (issue 58): split one that grows past this."""
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long


def test_the_engine_asks_no_source_what_it_is():
    """What a draft can do is declared (DraftSource.trees, own_length, model; a translating
    draft's prompt an argument), not discovered (issue 58): engine.py tests no type but the
    errors it turns into messages, and reads no attribute by name."""
    tree = ast.parse((PKG / "engine.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr"):
                found.append(f"{node.func.id} at line {node.lineno}")
            elif node.func.id == "isinstance":
                kind = ast.unparse(node.args[1])
                if not kind.endswith(("Error", "NoToken", "NonFinite")):
                    found.append(f"isinstance(..., {kind}) at line {node.lineno}")
    assert not found, found


def test_every_source_takes_its_hooks_from_one_place():
    """The no-op hooks live in drafts/base.py alone: no source writes an empty one."""
    empty = []
    for path in (PKG / "drafts").glob("*.py"):
        if path.name == "base.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("begin", "process",
                                                                   "accept", "end"):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and
                                                     isinstance(s.value, ast.Constant))]
                if all(isinstance(s, ast.Pass) for s in body):
                    empty.append(f"{path.name}: {node.name} at line {node.lineno}")
    assert not empty, empty



def _rooms() -> dict[str, set[str]]:
    """The import graph by room: a package (`drafts/`) or a top-level module (`engine.py`),
    the audit's wing left out (its own rule: test_the_audit_is_a_wing_of_its_own)."""
    mods = _modules()

    def room(m: str) -> str:
        parts = mods[m].relative_to(PKG).parts
        return parts[0] + "/" if len(parts) > 1 else parts[0]

    out: dict[str, set[str]] = {}
    for m, targets in _edges(mods).items():
        if room(m) != "audit/":
            out.setdefault(room(m), set()).update(
                room(t) for t in targets if room(t) not in ("audit/", room(m)))
    return out


def test_the_floors_on_the_map_are_the_imports():
    """docs/architecture.md's floors are computed from the imports, and its table says so:
    a room's floor is one above the highest it imports (1: it imports nothing of specli's).
    A top-level module is on the lowest row that names it (`errors.py`: row 1; the
    server's errors.py is under `server/`)."""
    rooms = _rooms()

    @functools.cache
    def floor(r: str) -> int:
        return 1 + max((floor(t) for t in rooms[r]), default=0)

    rows = {}
    for line in DOC.read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().isdigit():
            rows[int(cells[1])] = cells[2]
    wrong = []
    for r in sorted(rooms):
        on = [f for f, cell in rows.items() if f"`{r}`" in cell]
        if not on or min(on) != floor(r):
            wrong.append(f"{r}: the map says {min(on) if on else 'nothing'}, "
                         f"the imports {floor(r)}")
    assert not wrong, wrong
    assert floor("engine.py") > floor("drafts/") > floor("backend/") > floor("errors.py") == 1

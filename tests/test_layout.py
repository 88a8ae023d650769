"""The architecture's import rules (design.md), checked by reading the imports."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).parents[1] / "specli"
CORE = ["engine.py", "generate.py", "loadable.py", "verify.py", "stats.py", "config.py",
        "pairing.py", "ggufmeta.py", "tuning.py", "cost.py", "errors.py", "netguard.py",
        "_audit_site", "backend", "batching.py", "chat.py", "defaults.py", "drafts",
        "grammar_host.py", "plan.py", "prompt.py", "meter.py", "rules.py"]


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
        names = imports(PKG / "_audit_site" / name)
        assert {n.split(".")[0] for n in names} - {"__future__"} <= \
            set(sys.stdlib_module_names), name

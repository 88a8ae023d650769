"""docs/cli.md is the --help text; the README names the test command CI runs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_cli_docs  # noqa: E402


def test_cli_docs_match_help():
    assert (ROOT / "docs" / "cli.md").read_text() == gen_cli_docs.render(), \
        "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme and "\npython -m pytest\n" in ci

"""Where `specli audit` re-executes itself, as `python -I -S audit_boot.py`, before it
watches anything (specli/cli/audit.py, `reexec`).

A console script runs the environment's code before any of its own: `.pth` files,
sitecustomize, usercustomize, modules shadowed through PYTHONPATH. Code that stayed in the
auditor could wait for the run and connect from there, unwatched, in the host's network
namespace. exec ends it (its threads with it); with -I -S none of it runs again, and the path
the auditor imports from is the interpreter's and site-packages', without PYTHONPATH. What
the environment's code did before the exec (found by netguard.environment_code, and the
processes it started, which the auditor kills) is reported, and a verdict is then no proof.

Stdlib only: it runs before site-packages are on sys.path.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

AUDITOR_ENV = "SPECLI_AUDIT_AUDITOR"


def main() -> None:
    cfg = json.loads(os.environ[AUDITOR_ENV])
    sys.path[:] = cfg["path"]
    sys.argv[:] = cfg["argv"]
    runpy.run_module("specli", run_name="__main__")  # as `python -m specli ARGV`


if __name__ == "__main__":
    main()

"""Where `specli audit` re-executes itself, as `python -I -S audit_boot.py`, before it
watches anything (specli/cli/audit.py, `reexec`).

A console script runs the environment's code before any of its own: `.pth` files,
sitecustomize, usercustomize, modules shadowed through PYTHONPATH. Code that stayed in the
auditor could wait for the run and connect from there, unwatched, in the host's network
namespace. exec ends it (its threads with it); with -I -S none of it runs again, and the path
the auditor imports from is the interpreter's and site-packages', without PYTHONPATH. What
the environment's code did before the exec (found by audit.environment.environment_code, and the
processes it started, which the auditor kills) is reported, and a verdict is then no proof.

main() is stdlib only: it runs before site-packages are on sys.path. reexec() and early()
run in the first process, where they are: early() is the console entry point's first step,
so that `specli audit` re-executes before it imports the CLI (less of the environment's code
runs before the watch, and the auditor starts sooner).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

AUDITOR_ENV = "SPECLI_AUDIT_AUDITOR"


def reexec(argv: list[str]) -> None:
    """Replace this process with `python -I -S audit_boot.py ARGV` (never returns): the
    environment's code that ran at start-up stops here, threads and all, and never runs
    again; what it was goes along, for the report."""
    import site
    from pathlib import Path

    from specli.audit.environment import environment_code

    extra = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p}
    home = str(Path(__file__).resolve().parents[2])  # where `specli` imports from: first,
    path = [home] + [p for p in sys.path if p and os.path.realpath(p) not in extra  # so that
                     and os.path.realpath(p) != home]  # no folder a .pth adds shadows it
    cfg = {"path": path, "argv": argv, "env_code": environment_code(),
           "run_path": list(sys.path), "user_site": bool(site.ENABLE_USER_SITE)}
    env = {**os.environ, AUDITOR_ENV: json.dumps(cfg)}
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # closed (>&-): the auditor says so
            stream.flush()
    os.execve(sys.executable, [sys.executable, "-I", "-S", __file__], env)


def auditor() -> bool:
    """This process is the auditor of `specli audit` (the first process, or the one it
    re-executes), not the audited run (boot.ROLE_ENV; boot.py is not imported here: main()
    runs before site-packages are on the path)."""
    return sys.argv[1:2] == ["audit"] and os.environ.get("SPECLI_AUDIT_ROLE") != "audited"


def early() -> None:
    """`specli audit ...` started from a shell: re-execute now (never returns). Not in the
    re-executed auditor (-I -S), nor in the audited run."""
    if auditor() and not (sys.flags.isolated and sys.flags.no_site):
        reexec(["specli", *sys.argv[1:]])


def main() -> None:
    cfg = json.loads(os.environ[AUDITOR_ENV])
    sys.path[:] = cfg["path"]
    sys.argv[:] = cfg["argv"]
    runpy.run_module("specli", run_name="__main__")  # as `python -m specli ARGV`


if __name__ == "__main__":
    main()

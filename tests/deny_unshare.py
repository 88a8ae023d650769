"""Test-only: run a command where the kernel refuses new namespaces, as Docker's default
seccomp profile does for unprivileged containers.

    python tests/deny_unshare.py [--user-only] CMD ARGS...

Loads a seccomp filter (libseccomp, through the same loader as the audit) that makes unshare(2)
fail with EPERM in this process and everything it starts, then execs the command.
"""

from __future__ import annotations

import errno
import os
import sys

from specli.audit._site import boot


def main() -> None:
    """--user-only: refuse only new user namespaces (where they are off, root falls back to a
    network namespace alone)."""
    args = sys.argv[1:]
    user_only = args[:1] == ["--user-only"]
    args = args[user_only:]
    lib = boot.libseccomp()
    ctx = lib.seccomp_init(boot.ALLOW)
    nr = lib.seccomp_syscall_resolve_name(b"unshare")
    cmps = [boot._arg_cmp(0, 7, boot.CLONE_NEWUSER)] if user_only else []  # MASKED_EQ
    if cmps:
        cmps[0].datum_b = boot.CLONE_NEWUSER
    arr = (type(cmps[0]) * 1)(*cmps) if cmps else None
    assert lib.seccomp_rule_add_array(ctx, 0x00050000 | errno.EPERM, nr, len(cmps), arr) == 0
    assert lib.seccomp_load(ctx) == 0
    lib.seccomp_release(ctx)
    os.execvp(args[0], args)


if __name__ == "__main__":
    main()

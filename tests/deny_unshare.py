"""Test-only: run a command where the kernel refuses new namespaces, as Docker's default
seccomp profile does for unprivileged containers.

    python tests/deny_unshare.py CMD ARGS...

Loads a seccomp filter (libseccomp, through the same loader as the audit) that makes unshare(2)
fail with EPERM in this process and everything it starts, then execs the command.
"""

from __future__ import annotations

import errno
import os
import sys

from specli._audit_site import boot


def main() -> None:
    lib = boot.libseccomp()
    ctx = lib.seccomp_init(boot.ALLOW)
    nr = lib.seccomp_syscall_resolve_name(b"unshare")
    assert lib.seccomp_rule_add_array(ctx, 0x00050000 | errno.EPERM, nr, 0, None) == 0
    assert lib.seccomp_load(ctx) == 0
    lib.seccomp_release(ctx)
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()

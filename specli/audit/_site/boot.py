"""The audited process's first instructions: `specli audit` starts its generation as
`python -I -S boot.py` (see specli/audit/auditor.py, `Auditor`).

With `-I -S` nothing of the environment runs before this file: no `site`, no `.pth` file, no
`sitecustomize`, no PYTHONPATH. In order, it

1. installs the audit hook (the recorder, loaded by path from this folder),
2. moves into a new network namespace (when isolating),
3. loads a seccomp filter that hands every connect, bind, addressed sendto, sendmsg, sendmmsg
   and program start (execve) of this process and all its descendants to the auditor (a
   user-notification listener, whose descriptor the auditor takes with pidfd_getfd), and
   refuses io_uring (which bypasses it),
4. restores the auditor's sys.path and runs site's processing (`.pth` files, sitecustomize,
   usercustomize: all of it now watched),
5. runs specli (as `python -m specli` would) with the auditor's command line, in the audited
   role.

Stdlib only, and self-contained: it runs before site-packages are on sys.path. libseccomp
(Debian's libseccomp2, which apt itself depends on) is reached through ctypes: a Python binding
(pyseccomp) lives in site-packages, which are not importable before step 4.
"""

from __future__ import annotations

import json
import os
import sys

BOOT_ENV = "SPECLI_AUDIT_BOOT"
ROLE_ENV = "SPECLI_AUDIT_ROLE"
HERE = os.path.dirname(os.path.abspath(__file__))

ALLOW, NOTIFY = 0x7FFF0000, 0x7FC00000
SCMP_CMP_NE = 1
ENOSYS, EPERM = 38, 1
NOTIFIED = ("connect", "bind", "sendto", "sendmsg", "sendmmsg", "execve", "execveat")
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000


def libseccomp():
    """libseccomp through ctypes, or raise OSError. No ctypes.util.find_library: on Linux it
    spawns ldconfig, a process start the audit would record."""
    import ctypes

    for name in ("libseccomp.so.2", "libseccomp.so"):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            break
        except OSError:
            continue
    else:
        raise OSError("libseccomp is not installed (Debian/Ubuntu: libseccomp2)")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_notify_fd.argtypes = [ctypes.c_void_p]
    return lib


def _arg_cmp(arg: int, op: int, datum: int):
    """A struct scmp_arg_cmp (ctypes is imported only when a filter is built)."""
    import ctypes

    class ArgCmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                    ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]
    return ArgCmp(arg, op, datum, 0)


def load_filter() -> int:
    """Load the notifying filter into this process (inherited by every descendant); return the
    listener's descriptor. OSError when libseccomp or the kernel refuses."""
    lib = libseccomp()
    ctx = lib.seccomp_init(ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        def rule(action: int, name: str, *cmps) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return  # not a syscall on this architecture
            arr = (type(cmps[0]) * len(cmps))(*cmps) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

        rule(NOTIFY, "connect")
        rule(NOTIFY, "bind")  # a unix socket path is reachable from outside the namespace
        rule(NOTIFY, "sendto", _arg_cmp(4, SCMP_CMP_NE, 0))  # only with a destination
        rule(NOTIFY, "sendmsg")
        rule(NOTIFY, "sendmmsg")
        rule(NOTIFY, "execve")  # every program started, whatever the recorder's log says
        rule(NOTIFY, "execveat")
        for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
            rule(0x00050000 | ENOSYS, name)  # SCMP_ACT_ERRNO: io_uring bypasses seccomp
        # no way back into another network namespace, and no reaching into the auditor (root
        # without user namespaces keeps CAP_SYS_PTRACE): the generation needs none of these
        for name in ("setns", "ptrace", "process_vm_readv", "process_vm_writev",
                     "pidfd_getfd"):
            rule(0x00050000 | EPERM, name)
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
        fd = lib.seccomp_notify_fd(ctx)
        if fd < 0:
            raise OSError(-fd, f"seccomp_notify_fd: {os.strerror(-fd)}")
        return fd  # libseccomp keeps no other copy open: the caller hands it over, then closes

    finally:
        lib.seccomp_release(ctx)


def unshare(flags: int) -> int:
    """0, or the errno of unshare(2) (os.unshare is Python 3.12+)."""
    if hasattr(os, "unshare"):
        try:
            os.unshare(flags)
        except OSError as e:
            return e.errno or 1
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()


# capabilities root keeps no longer where user namespaces are off (the fallback below): what
# reaches the host's network or other processes from a namespace of its own (netlink can
# move a host interface in; ptrace and raw I/O reach other processes and devices)
_DROPPED = (12, 13, 16, 17, 19, 21, 22, 27, 38, 39)  # NET_ADMIN NET_RAW SYS_MODULE SYS_RAWIO
#                                 SYS_PTRACE SYS_ADMIN SYS_BOOT MKNOD PERFMON BPF


def drop_capabilities() -> None:
    """Drop _DROPPED from this process's bounding, effective, permitted and inheritable sets
    (its children's too). OSError if the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in _DROPPED:
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    head, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(head), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for cap in _DROPPED:
        word, bit = divmod(cap, 32)
        for field in ("effective", "permitted", "inheritable"):
            setattr(data[word], field, getattr(data[word], field) & ~(1 << bit))
    if libc.capset(ctypes.byref(head), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


LANDLOCK_MAKE_SOCK, LANDLOCK_MAKE_BLOCK = 1 << 9, 1 << 11
LANDLOCK_SCOPE_ABSTRACT_UNIX, LANDLOCK_SCOPE_SIGNAL = 1 << 0, 1 << 1


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is off)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # _VERSION
    return max(int(abi), 0)


def landlock() -> int:
    """Put this process and everything it starts in a Landlock domain; its ABI version, or 0
    where the kernel has none. A domain cannot reach into a process outside it (ptrace, and
    everything ptrace's rules guard: /proc/PID/mem, /proc/PID/fd, a process's environment);
    here it may also not create socket or block device files (a listener someone outside
    could connect to, a raw disk), nor, from ABI 6, signal a process outside it or connect
    to an abstract unix socket made outside. Nothing else is restricted."""
    import ctypes

    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    attr = (ctypes.c_uint64 * 3)(LANDLOCK_MAKE_SOCK | LANDLOCK_MAKE_BLOCK, 0,
                                 LANDLOCK_SCOPE_ABSTRACT_UNIX | LANDLOCK_SCOPE_SIGNAL
                                 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = libc.syscall(444, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (seccomp sets it too)
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        if libc.syscall(446, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(fd)
    return abi


def isolate(drop: bool = True) -> tuple[str, str]:
    """(how, "") or ("", why not): a new network namespace for this single-threaded process,
    inside a new user namespace where it can (so that even root keeps no capability over the
    host's namespaces: no setns back), mapping its own uid and gid to themselves. Where user
    namespaces are off, root's network namespace alone, and (`drop`) root's capabilities that
    reach out of it dropped (the auditor keeps them: the run's own namespace needs them)."""
    uid, gid = os.geteuid(), os.getegid()
    e1 = unshare(CLONE_NEWUSER | CLONE_NEWNET)
    if not e1:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            except OSError:
                pass  # unmapped ids read as the overflow id; access is still the real id's
        return "user and network namespaces", ""
    e2 = unshare(CLONE_NEWNET)  # root where user namespaces are off: setns is refused by the
    if not e2:                  # seccomp filter, and what else reaches out by capabilities
        if not drop:
            return "network namespace", ""
        try:
            drop_capabilities()
        except OSError as e:
            return "", f"unshare(CLONE_NEWNET) worked, but dropping capabilities failed: {e}"
        return "network namespace (capabilities dropped)", ""
    return "", (f"unshare(CLONE_NEWUSER | CLONE_NEWNET): {os.strerror(e1)}; "
                f"unshare(CLONE_NEWNET): {os.strerror(e2)}")


def _recorder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("specli_audit_recorder",
                                                  os.path.join(HERE, "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["specli_audit_recorder"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    cfg = json.loads(os.environ.pop(BOOT_ENV))
    status, go = cfg["status_fd"], cfg["go_fd"]
    _recorder().install()  # 1: from here on, every Python-level call is recorded
    import ctypes

    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL: never run unwatched
    if os.getppid() != cfg["auditor"]:
        os._exit(2)

    def wait_for(expected: bytes) -> bytes:
        got = os.read(go, 1)
        if len(got) != 1 or got not in expected:  # EOF: the auditor is gone
            os._exit(2)
        return got

    def say(**kw) -> None:
        os.write(status, (json.dumps(kw) + "\n").encode())

    if cfg["isolate"]:  # 2
        how, why = isolate()
        if not how:
            say(error=f"network isolation is not permitted here: {why}")
            sys.exit(2)
        try:  # 2b: no reaching into the user's other processes, outside the namespace
            abi = landlock()
        except OSError as e:
            say(error=f"the Landlock domain could not be made: {e}")
            sys.exit(2)
        if cfg.get("landlock") and not abi:
            say(error="this kernel has no Landlock, which the auditor found a moment ago")
            sys.exit(2)
    # 3: a filter only once the auditor has shown it can take descriptors from this process
    # (pidfd_getfd, Linux 5.6+, ptrace rules): a listener nobody serves would hang every call
    say(ready=True)
    fd = None
    if wait_for(b"yn") == b"y":
        try:
            fd = load_filter()
            say(seccomp_fd=fd)
        except OSError as e:
            say(seccomp_fd=None, seccomp_error=str(e))
    wait_for(b"g")  # the auditor holds the listener now (or knows there is none)
    for d in (fd, status, go):
        if d is not None:
            os.close(d)
    # 4: the path the auditor had, without this folder (its sitecustomize is the recorder,
    # already installed; the one it shadows is the user's, and site imports that one now)
    sys.path[:] = [p for p in cfg["path"] if os.path.abspath(p or ".") != HERE]
    import site

    site.ENABLE_USER_SITE = cfg["user_site"]
    site.main()
    os.environ[ROLE_ENV] = "audited"  # 5: as `python -m specli audit ...` would
    sys.argv[:] = cfg["argv"]
    import runpy

    runpy.run_module("specli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

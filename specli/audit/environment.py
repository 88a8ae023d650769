"""What a proof rests on in the process itself: no code of the environment ran before specli,
no socket was handed in, and which variables could turn network use on.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from specli.audit._site import sitecustomize as recorder
from specli.audit.events import EXTERNAL, LOCAL, RESULT_ENV, NetEvent, host_scope, hostport

# environment variables that can make a run use the network, or say how it would
_ENV = re.compile(r"^(HF_|HUGGINGFACE_|HUGGING_FACE_|SPECLI_)|_PROXY$|^(SSL_CERT_FILE|SSL_CERT_DIR|"
                  r"REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE)$", re.IGNORECASE)


_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


def environment_code(environ: dict[str, str] | None = None) -> list[str]:
    """The environment's code that ran in this interpreter before specli did: sitecustomize
    and usercustomize (not the interpreter's own), `.pth` files with import lines that no
    installed distribution owns, and modules imported from PYTHONPATH (specli's own aside)."""
    import glob
    import site

    env = os.environ if environ is None else environ
    own = [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, "/etc")]

    def under(path: str, roots) -> bool:
        real = os.path.realpath(path)
        return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

    found = []
    for var in ("LD_PRELOAD", "LD_AUDIT"):  # the loader puts them in every process
        if env.get(var, "").strip():
            found.append(f"{var}={env[var]}")
    for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):  # one that shadows the
        if d and glob.glob(os.path.join(d, "libseccomp.so*")):    # audit's own library
            found.append(f"libseccomp from LD_LIBRARY_PATH ({d})")
    for name in ("sitecustomize", "usercustomize"):
        f = getattr(sys.modules.get(name), "__file__", None)
        if f and not under(f, own):
            found.append(f"{name} ({f})")
    extra = {os.path.realpath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    for name, m in list(sys.modules.items()):
        f = getattr(m, "__file__", None)
        if not f or "." in name or name in ("specli", "sitecustomize", "usercustomize"):
            continue
        # the folder a top-level module was found in: a package's parent, a module's own
        home = Path(f).parent.parent if Path(f).name.startswith("__init__.") else Path(f).parent
        if extra and os.path.realpath(home) in extra:
            found.append(f"module {name} from PYTHONPATH ({f})")
    dirs = list(site.getsitepackages()) + ([site.getusersitepackages()]
                                          if site.ENABLE_USER_SITE else [])
    owned = None
    for d in dirs:
        for pth in sorted(glob.glob(os.path.join(d, "*.pth"))):
            try:
                lines = Path(pth).read_text(errors="replace").splitlines()
            except OSError:
                continue
            if not any(line.startswith(("import ", "import\t")) for line in lines):
                continue
            if owned is None:
                owned = _owned_pth()
            if os.path.realpath(pth) not in owned:
                found.append(f".pth file that runs code, owned by no installed package ({pth})")
    return found


def _owned_pth() -> set[str]:
    from importlib import metadata

    out = set()
    for dist in metadata.distributions():
        listed = "".join(dist.read_text(name) or "" for name in ("RECORD", "installed-files.txt",
                                                                 "SOURCES.txt"))
        if ".pth" not in listed:  # most: their file list is not worth parsing (0.2 s for all)
            continue
        for f in dist.files or ():
            if str(f).endswith(".pth"):
                out.add(os.path.realpath(str(dist.locate_file(f))))
    return out


def standard_streams() -> list[NetEvent]:
    """Stdin, stdout and stderr that are sockets: the run writes (or reads) through them, to
    whoever is at the other end. An event each, scoped by that peer."""
    import socket
    import stat

    out = []
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            try:
                peer = s.getpeername()
            except OSError:
                peer = None
            family = s.family
        if family in (socket.AF_INET, socket.AF_INET6):
            proto = ("tcp" if s.type == socket.SOCK_STREAM else "udp") + \
                ("6" if family == socket.AF_INET6 else "")
            where = hostport(str(peer[0]), peer[1]) if peer else "(no peer)"
            scope = host_scope(str(peer[0])) if peer else EXTERNAL
        elif family == socket.AF_UNIX:
            proto, scope = "unix", LOCAL
            where = (peer.decode("utf-8", "replace") if isinstance(peer, bytes) else peer) or \
                "(unnamed peer)"
        else:
            proto, scope, where = f"family {int(family)}", EXTERNAL, "(unknown peer)"
        out.append(NetEvent("inherited descriptor", scope, os.getpid(), 0.0,
                            f"{name}: {proto} socket to {where}", proto,
                            "handed to the run by whoever started specli audit", None,
                            "auditor"))
    return out


def network_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that can turn on (or describe) network use: HF_*, HUGGINGFACE_*,
    HUGGING_FACE_*, SPECLI_*, proxies and CA bundles; secrets and proxy passwords redacted."""
    env = os.environ if environ is None else environ
    out = {}
    for k in sorted(env):
        if not _ENV.search(k) or k in (recorder.LOG_ENV, RESULT_ENV, "SPECLI_AUDIT_ROLE",
                                       "SPECLI_AUDIT_AUDITOR"):
            continue
        v = env[k]
        if _SECRET.search(k) and v:
            v = "(set, redacted)"
        elif "@" in v:  # a proxy URL's user:password (or a token as the user name)
            v = re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)?.*@", r"\1***@", v)  # to the last @
        out[k] = v
    return out

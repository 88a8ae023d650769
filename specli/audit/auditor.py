"""The auditor: starts the audited process (`python -I -S _site/boot.py`), runs the four
layers around it, and gathers what they saw.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from specli.audit._site import sitecustomize as recorder
from specli.audit.events import (
    AF_NETLINK,
    AF_UNIX,
    EXTERNAL,
    LOCAL,
    OUTLIVED,
    PROCESS,
    RESULT_ENV,
    AuditError,
    NetEvent,
    host_scope,
)
from specli.audit.poller import ProcPoller, cmdline, descendants
from specli.audit.supervisor import Supervisor
from specli.audit.tracee import getfd
from specli.audit.verdict import merge, unpeered

SITE_DIR = str(Path(recorder.__file__).parent)


# devices a new network namespace gets when their modules are loaded: down, no address
_FALLBACK_DEVICES = {"sit0", "tunl0", "ip6tnl0", "ip6gre0", "gre0", "gretap0", "erspan0",
                     "ip_vti0", "ip6_vti0", "ip6erspan0"}


def _subreaper() -> None:
    """Adopt orphaned descendants (a daemon's double fork), so that the /proc walk still finds
    them below this process and the auditor can wait for them (PR_SET_CHILD_SUBREAPER)."""
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        raise AuditError("cannot become a child subreaper (prctl PR_SET_CHILD_SUBREAPER): "
                         "daemons of the audited run could not be followed")


@dataclass
class Audit:
    """What the auditor saw of one audited run."""

    events: list[NetEvent]
    exit_code: int  # the audited process's
    seconds: float
    polls: int
    isolated: dict | None  # netns and interfaces, read by the auditor (not claimed)
    seccomp: str  # "" when active, else why not
    result: dict | None  # what the audited process wrote: models, run statistics

    @property
    def outlived(self) -> int:
        return sum(e.scope == OUTLIVED for e in self.events)


class Auditor:
    """Run `argv` (a specli command line) as the audited process, watched from its first
    instruction to the exit of the last process of its tree.

    The audited process is `python -I -S boot.py`: the recorder, the namespace and the seccomp
    filter come before anything else runs in it. This process stays outside: child subreaper
    (orphans and daemons are adopted), it polls /proc for the tree's sockets, serves the
    seccomp listener, and after the audited process exits waits `grace` seconds for the rest
    of the tree, then kills what outlives the run and reports it."""

    def __init__(self, argv: list[str], isolate: bool, interval: float = 0.02,
                 grace: float = 2.0, run_path: list[str] | None = None,
                 user_site: bool | None = None, landlock: bool = False):
        """run_path, user_site: the audited run's sys.path and user site (the user's own
        environment, PYTHONPATH included), where they differ from this process's."""
        self.argv, self.isolate, self.interval, self.grace = argv, isolate, interval, grace
        self.run_path, self.user_site, self.landlock = run_path, user_site, landlock

    def run(self) -> Audit:
        import site
        import subprocess

        from specli.audit._site import boot

        _subreaper()
        # nothing in the tree may ptrace this process (pidfd_getfd its listener, read its
        # memory): a process in another user namespace needs a capability it does not have
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
        me, t0 = os.getpid(), time.time()
        self._poll_failed: BaseException | None = None
        temps: list[str] = []
        fds: list[int] = []
        proc = supervisor = None
        seccomp, isolated = "", None
        stop = self._stop = threading.Event()
        thread = threading.Thread(target=self._poll, daemon=True, name="specli-audit-poll")
        events: list[NetEvent] = []
        outlived: list[NetEvent] = []
        try:
            for suffix in (".jsonl", ".json"):
                fd, path = tempfile.mkstemp(prefix="specli-audit-", suffix=suffix)
                os.close(fd)
                temps.append(path)
            log, result = temps
            status_r, status_w = os.pipe()
            go_r, go_w = os.pipe()
            fds += [status_r, status_w, go_r, go_w]
            cfg = {"status_fd": status_w, "go_fd": go_r, "isolate": self.isolate,
                   "auditor": me, "path": list(self.run_path or sys.path),
                   "user_site": bool(site.ENABLE_USER_SITE if self.user_site is None
                                     else self.user_site), "argv": self.argv,
                   "landlock": self.landlock}
            env = {**os.environ, recorder.LOG_ENV: log, RESULT_ENV: result,
                   boot.BOOT_ENV: json.dumps(cfg),
                   "PYTHONPATH": os.pathsep.join(p for p in (SITE_DIR,
                                                             os.environ.get("PYTHONPATH")) if p)}
            poller = ProcPoller(me, t0, skip=me)
            poller.baseline()
            self._poller = poller
            proc = subprocess.Popen([sys.executable, "-I", "-S", boot.__file__], env=env,
                                    pass_fds=(status_w, go_r))
            for d in (status_w, go_r):
                os.close(d)
                fds.remove(d)
            status = os.fdopen(status_r, "rb")
            fds.remove(status_r)
            with status:
                state = self._say(status, proc)
                try:  # can this process take the audited one's descriptors? (a filter
                    os.close(getfd(proc.pid, status_w))  # nobody serves would hang it)
                    os.write(go_w, b"y")
                    state = self._say(status, proc)
                except OSError as e:
                    seccomp = f"cannot take the audited process's descriptors ({e})"
                    os.write(go_w, b"n")
                if state.get("seccomp_fd") is not None:
                    try:
                        supervisor = Supervisor(
                            getfd(proc.pid, state["seccomp_fd"]), t0, self.isolate)
                    except OSError as e:  # it was possible a moment ago: no verdict
                        raise AuditError(f"cannot take the seccomp listener: {e}") from None
                elif not seccomp:
                    seccomp = state.get("seccomp_error") or "not loaded"
                if self.isolate:
                    isolated = self._check_isolated(proc.pid)
                if supervisor:
                    supervisor.start()
                thread.start()
                os.write(go_w, b"g")
            code = self._wait(proc, supervisor)
            outlived = self._outlive(me, t0, supervisor)
        except BaseException as e:
            for pid in descendants(me)[1:]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if proc is not None:
                with contextlib.suppress(ChildProcessError, OSError):
                    proc.wait()
            if isinstance(e, OSError):
                raise AuditError(f"the audit failed: {e}") from None
            raise
        finally:
            for d in fds:
                with contextlib.suppress(OSError):
                    os.close(d)
            stop.set()
            if thread.ident is not None:
                thread.join()
            if supervisor:
                supervisor.stop()
            if temps and os.path.exists(temps[0]):
                events = self._recorded(temps[0], t0)
            doc = None
            if len(temps) > 1:
                with contextlib.suppress(OSError, ValueError):
                    doc = json.loads(Path(temps[1]).read_text() or "null")
            for path in temps:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        poller.poll()
        events = merge(events, supervisor.events if supervisor else [])
        events = sorted(unpeered(events + poller.events) + outlived, key=lambda e: e.t)
        self._check_watch(supervisor)
        return Audit(events, code, time.time() - t0, poller.polls, isolated, seccomp,
                     doc if isinstance(doc, dict) else None)

    def _check_watch(self, supervisor: Supervisor | None) -> None:
        """A failed listener or poll means what happened was not all seen: no verdict."""
        for failed, what in ((supervisor.failed if supervisor else None, "seccomp listener"),
                             (self._poll_failed, "/proc poll")):
            if failed is not None:
                raise AuditError(f"the {what} failed: {failed!r}")

    @staticmethod
    def _say(status, proc) -> dict:
        """The audited process's next status line; AuditError if it refused or ended."""
        line = status.readline()
        try:
            state = json.loads(line) if line.strip() else {}
        except ValueError:
            state = {}
        if "error" in state:
            raise AuditError(str(state["error"]))
        if not isinstance(state, dict) or not state:
            raise AuditError(f"the audited process ended before it began (exit {proc.wait()})")
        return state

    def _poll(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self._poller.poll()
        except BaseException as e:  # noqa: BLE001 - reported by run(): the audit failed
            self._poll_failed = e

    @staticmethod
    def _check_isolated(pid: int) -> dict:
        """The audited process's namespace, read from here: its claim is not trusted. Only lo,
        or the fallback tunnel devices the kernel adds to every new namespace when their
        modules are loaded (down, addressless), and no route anywhere but on lo."""
        try:
            mine, theirs = os.readlink("/proc/self/ns/net"), os.readlink(f"/proc/{pid}/ns/net")
            names = sorted(line.split(":")[0].strip() for line in
                           Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:])
            v4 = Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]
            v6 = [line.split()[-1] for line in
                  Path(f"/proc/{pid}/net/ipv6_route").read_text().splitlines() if line.strip()]
        except OSError as e:
            raise AuditError(f"cannot read the audited process's network namespace: {e}") \
                from None
        extra = [n for n in names if n != "lo" and n not in _FALLBACK_DEVICES]
        if theirs == mine or extra or v4 or any(dev != "lo" for dev in v6):
            raise AuditError(f"not isolated: the audited process's network namespace {theirs} "
                             f"has {', '.join(names)}"
                             + (" and routes" if v4 or any(d != "lo" for d in v6) else ""))
        return {"netns": theirs, "interfaces": names}

    def _wait(self, proc, supervisor: Supervisor | None) -> int:
        """The audited process's exit code; orphans adopted meanwhile are reaped as they go. A
        failed listener or poll stops the run: no verdict."""
        while True:
            self._check_watch(supervisor)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                return proc.wait()
            if pid == proc.pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return proc.returncode
            if pid == 0:
                time.sleep(0.01)

    def _outlive(self, me: int, t0: float, supervisor: Supervisor | None) -> list[NetEvent]:
        """Wait up to `grace` for the rest of the tree (atexit handlers finish, daemons run);
        then kill and report what is left."""
        deadline = time.monotonic() + self.grace
        out: list[NetEvent] = []
        while True:
            self._check_watch(supervisor)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            rest = [p for p in descendants(me) if p != me and not _zombie(p)]
            if not rest:
                return out
            if time.monotonic() >= deadline:
                for pid in rest:
                    if pid not in {e.pid for e in out}:
                        out.append(NetEvent("outlived the run", OUTLIVED, pid, time.time() - t0,
                                            cmdline(pid), "", f"killed after a {self.grace:g} s "
                                            "grace period", "killed", "auditor"))
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    @staticmethod
    def _recorded(log: str, t0: float) -> list[NetEvent]:
        """The recorder's lines (the audited process and its Python children) as events."""
        recs, outcomes = [], {}
        with open(log, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a child killed mid-write: its last line
                if not isinstance(rec, dict):
                    continue
                if "ref" in rec:
                    outcomes[rec["ref"]] = rec.get("outcome")
                elif "event" in rec and "pid" in rec and "t" in rec:
                    recs.append(rec)
        out = []
        for rec in recs:
            try:
                if rec["event"] in recorder.PROCESS:
                    cmd = rec.get("command")
                    scope = PROCESS
                    address = shlex.join(map(str, cmd)) if isinstance(cmd, list) else _text(cmd)
                else:
                    scope, address = _address(rec)
                proto = {1: "unix", 2: "inet", 10: "inet6", 16: "netlink"}.get(
                    rec.get("family"), "")
                if proto.startswith("inet"):
                    proto += {1: "/tcp", 2: "/udp"}.get(rec.get("type", 0) & 0xF, "")
                out.append(NetEvent(str(rec["event"]), scope, int(rec["pid"]),
                                    float(rec["t"]) - t0, address, proto,
                                    str(rec.get("where", "")), outcomes.get(rec.get("id"))))
            except (TypeError, ValueError, KeyError):  # a forged or broken line: kept, as is
                out.append(NetEvent("unreadable record", EXTERNAL, 0, 0.0, _text(rec)[:200],
                                    source="hook"))
        return out


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def _address(rec: dict) -> tuple[str, str]:
    """(scope, address as text) of one recorder line."""
    event, addr = rec["event"], rec.get("address")
    family = rec.get("family")
    if family in (AF_UNIX, AF_NETLINK):
        return LOCAL, _text(addr)
    if family is not None:  # a socket method with an (host, port, ...) address
        host = addr[0] if isinstance(addr, list) and addr else None
        if event == "socket.sendmsg" and addr is None:
            return LOCAL, "(connected socket)"
        return host_scope(host, listening=event == "socket.bind"), _hostport(addr)
    if event in ("urllib.Request", "webbrowser.open"):
        url = addr[0] if isinstance(addr, list) and addr else str(addr)
        return host_scope(urlsplit(str(url)).hostname or ""), str(url)
    host = addr[0] if isinstance(addr, list) and addr else addr
    if isinstance(host, list):  # getnameinfo's sockaddr
        return host_scope(host[0] if host else None), _hostport(host)
    return host_scope(None if host is None else str(host)), _hostport(addr)


def _hostport(addr) -> str:
    if isinstance(addr, list) and len(addr) >= 2 and isinstance(addr[1], (int, str)):
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    if isinstance(addr, list) and len(addr) == 1:
        return str(addr[0])
    return _text(addr)


def _text(v) -> str:
    return "" if v is None else (v if isinstance(v, str) else json.dumps(v))

"""specli audit on real models: a clean run, planted attempts in every mode, isolation.

Every attempt aimed at a non-loopback address is planted (tests/plant/sitecustomize.py) in an
audit started inside `unshare --net --mount` (tests/standin.py), a fresh namespace where
203.0.113.7 is a local listener standing in for the outside: nothing can leave the machine,
and the listener tells whether the attempt got out of the audited process's namespace.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import specli

from specli.audit import auditor, environment, events, poller, verdict
from specli.audit._site import boot

TESTS = Path(__file__).parent
ROOT = TESTS.parent
NOWHERE = "203.0.113.7:9"


def _can(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True).returncode == 0
    except OSError:
        return False


CAN_NETNS = _can(["unshare", "--net", "true"])
needs_netns = pytest.mark.skipif(not CAN_NETNS, reason="unshare --net is not permitted: planted "
                                 "attempts need a fresh network namespace (root or user "
                                 "namespaces)")
needs_standin = pytest.mark.skipif(
    not (CAN_NETNS and shutil.which("ip") and _can(["unshare", "--net", "--mount", "true"])),
    reason="the stand-in for the outside needs unshare --net --mount and iproute2 (ip)")


@pytest.fixture(scope="module")
def pair(f16, q4_1) -> list[str]:
    return ["-m", f16, "-md", q4_1, "-p", "Write a sorting algorithm", "-n", "8", "--temp", "0"]


@pytest.fixture(scope="module")
def small(heads) -> list[str]:
    """The cheapest real run: the attempt matrix is about the watch, not the model. The tiny
    random-weight llama of the heads' tests (SmolLM2's tokenizer, 2 MB: half a second less a
    run than SmolLM2 itself, its sha256 at once), no warm-up decode either."""
    return ["-m", heads["llama"], "-p", "Hi", "-n", "2", "--temp", "0", "--no-warmup"]


MODES = {"isolated": (), "no-isolate": ("--no-isolate",),
         "refused+allow": ("--allow-unisolated",)}
# a plant arrives through the environment (PYTHONPATH), which the auditor's own interpreter
# runs too before it re-executes itself: isolated, that is no proof without --allow-unproven
UNPROVEN = "--allow-unproven"


def audit(*args: str, kind: str | None = None, mode: str = "isolated", standin: bool = True,
          tmp: Path | None = None, env: dict | None = None,
          ) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run `specli audit ARGS` (with a plant, in a mode); (process, what the stand-in
    listeners received, or None without the stand-in)."""
    cmd = [sys.executable, "-m", "specli", "audit", *args, *MODES[mode]]
    if kind and mode == "isolated" and UNPROVEN not in args:
        cmd.append(UNPROVEN)
    if mode == "refused+allow":
        cmd = [sys.executable, str(TESTS / "deny_unshare.py"), *cmd]
    out = None
    if standin:
        assert tmp is not None, "the stand-in writes what it received into tmp"
        out = tmp / "standin.json"
        cmd = ["unshare", "--net", "--mount", sys.executable, str(TESTS / "standin.py"),
               str(out), *cmd]
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        ([str(TESTS / "plant")] if kind else []) + [str(ROOT)])}
    if kind:
        env["SPECLI_TEST_PLANT"] = kind
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    received = json.loads(out.read_text()) if out is not None else None
    return r, received


def planted(r: subprocess.CompletedProcess, kind: str) -> tuple[int, str]:
    """(pid, outcome) the plant reported on stderr."""
    m = re.search(rf"^plant: {re.escape(kind)} pid (\d+): (.*)$", r.stderr, re.M)
    assert m, r.stderr
    return int(m.group(1)), m.group(2)


def sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@needs_netns
def test_clean_run_reports_models_and_no_events(pair, f16, q4_1):
    r = specli("audit", *pair, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and doc["exit_code"] == 0
    assert doc["events"] == [] and doc["counted"] == []
    assert [(m["role"], m["path"], m["size"], m["sha256"]) for m in doc["models"]] == [
        ("target", f16, os.path.getsize(f16), sha256(f16)),
        ("draft", q4_1, os.path.getsize(q4_1), sha256(q4_1))]
    assert doc["run"]["n_predict"] == 8 and doc["run"]["n_drafted"] > 0
    assert doc["poll"]["polls"] >= 5  # the thread polled
    # the default: isolated, so the verdict is a proof
    assert doc["isolated"] is True and doc["proof"] is True and doc["mode"] == "isolated"
    assert doc["namespace"]["interfaces"] == ["lo"]
    assert doc["namespace"]["netns"] != os.readlink("/proc/self/ns/net")
    assert doc["seccomp"] == {"active": True, "reason": None}


@needs_netns
def test_clean_run_text_report(pair):
    r = specli("audit", *pair, env={"HF_TOKEN": "hf_secret", "HTTPS_PROXY":
                                    "http://user:pw@proxy.example:3128"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "[ models loaded ]" in out and "sha256 " in out
    assert "no external connections" in out and "accepted tokens: " in out
    assert "HF_TOKEN=(set, redacted)" in out and "hf_secret" not in out
    assert "HTTPS_PROXY=http://***@proxy.example:3128" in out and "pw@" not in out
    assert out.rstrip().splitlines()[-1].startswith(
        "verdict: clean, proven: no network connection from the run's processes could leave "
        "this machine")


@needs_standin
@pytest.mark.parametrize("mode", list(MODES))
def test_clean_run_in_every_mode(small, mode, tmp_path):
    r, received = audit(*small, "--json", mode=mode, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and received["received"] == []
    assert doc["proof"] is (mode == "isolated")
    assert doc["mode"] == {"isolated": "isolated",
                           "no-isolate": "unisolated (--no-isolate)",
                           "refused+allow": "unisolated (isolation refused)"}[mode]
    assert bool(doc["isolation_refused"]) is (mode == "refused+allow")
    assert (doc["blind_spots"][0] == "nothing is stopped: what is reported has happened") is \
        (mode != "isolated")


@needs_standin
def test_unisolated_text_verdict_says_observation(small, tmp_path):
    r, _ = audit(*small, mode="no-isolate", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[ blind spots of an unisolated audit ]" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith(
        "verdict: clean, observed (not a proof: not isolated")


@needs_netns
def test_isolation_refused_is_exit_2_before_any_work(small):
    """Where the kernel refuses namespaces (as Docker's default profile does), the default
    audit says so in one line and exits 2, without running the generation unisolated."""
    r = subprocess.run([sys.executable, str(TESTS / "deny_unshare.py"), sys.executable, "-m",
                        "specli", "audit", *small, "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: network isolation is not permitted here (unshare("
                               "CLONE_NEWUSER | CLONE_NEWNET): Operation not permitted; "
                               "unshare(CLONE_NEWNET): Operation not permitted)")
    assert "--allow-unproven" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# The attempt matrix: every planted attempt, in every mode, is recorded (exit 1); isolated,
# the stand-in listener receives nothing; unisolated, it does (the attempt was real).
KINDS = ["connect", "sendto", "getaddrinfo", "c-tcp", "c-udp", "c-udp-burst", "c-dns",
         "posix-spawn", "system", "python-I", "daemon", "atexit", "tamper", "early", "setns"]
# Unisolated, the attempt is real (the stand-in receives it) and recorded: one kind per way
# out (Python socket, C socket, DNS, a child process, a process that outlives the run, a
# plant that starts before the hook) shows it; every kind is shown recorded isolated.
CELLS = [(k, "isolated") for k in KINDS] + \
    [(k, "no-isolate") for k in ("connect", "c-udp", "c-dns", "system", "daemon", "early")] + \
    [(k, "refused+allow") for k in ("c-tcp", "python-I", "tamper", "daemon")]


@needs_standin
@pytest.mark.parametrize("kind, mode", CELLS)
def test_every_attempt_is_recorded_in_every_mode(small, kind, mode, tmp_path):
    r, received = audit(*small, "--json", kind=kind, mode=mode, tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    planter, outcome = planted(r, kind)
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "network use seen"
    hits = [e for e in doc["counted"] if e["address"].startswith("203.0.113.7:")]
    assert hits, doc["counted"]
    assert all(e["scope"] == "external" for e in hits)
    if kind == "daemon":
        assert any(e["scope"] == "outlived" and e["outcome"] == "killed" for e in doc["counted"])
    if kind in ("posix-spawn", "system", "python-I", "daemon"):  # another process's attempt
        assert any(e["pid"] != planter for e in hits)
    if kind == "setns":  # refused, isolated or not: the filter denies it
        assert re.search(r"^plant: setns joined=(False|Permission denied)$", r.stderr, re.M)
    assert doc["proof"] is False  # the plant came through the environment (see UNPROVEN)
    if mode == "isolated":
        assert doc["isolated"] is True and "sitecustomize" in doc["unproven"][0]
        assert received["received"] == [], received  # nothing got out
        if kind not in ("daemon", "atexit"):  # those act after the plant reported
            assert outcome != "ok"  # the attempt failed where it was made
    else:
        assert received["received"], "the stand-in saw nothing: the attempt was not real"


@needs_standin
def test_python_attempt_keeps_its_caller_and_outcome(small, tmp_path):
    r, _ = audit(*small, "--json", kind="connect", tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    planter, _ = planted(r, "connect")
    doc = json.loads(r.stdout)
    [e] = [e for e in doc["counted"] if e["event"] == "socket.connect"]
    assert (e["address"], e["proto"], e["pid"], e["outcome"], e["source"]) == (
        NOWHERE, "inet/tcp", planter, "ENETUNREACH", "hook+seccomp")
    assert e["where"].endswith("in connect") and "sitecustomize.py" in e["where"]


@needs_standin
def test_dns_lookup_is_an_attempt_even_when_it_fails(small, tmp_path):
    r, _ = audit(*small, "--json", kind="c-dns", tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert any(e["address"] == "203.0.113.7:53 (DNS)" and e["source"] == "seccomp"
               for e in doc["counted"])


@needs_standin
def test_udp_is_judged_by_destination(small, tmp_path):
    """A datagram socket that sent to 203.0.113.7 without ever connecting is external."""
    r, _ = audit(*small, "--json", kind="c-udp-burst", mode="no-isolate", tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    sends = [e for e in doc["counted"] if e["event"] == "sendto"]
    assert sends and {e["address"] for e in sends} == {NOWHERE}
    assert all(e["scope"] != "local" for e in doc["events"] if e["proto"].startswith("udp"))


@needs_standin
def test_planted_attempt_text_report(small, tmp_path):
    r, _ = audit(*small, kind="c-tcp", tmp=tmp_path)
    assert r.returncode == 1
    assert f"[seccomp] connect {NOWHERE} (inet)" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith(
        "verdict: NETWORK USE SEEN: 1 event(s) counted: none could leave this machine")


def test_loopback_is_reported_and_fails_only_with_strict(small):
    r, _ = audit(*small, "--json", kind="loopback", mode="no-isolate", standin=False)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counted"] == []
    seen = {(e["source"], e["event"], e["scope"], e["proto"]) for e in doc["events"]}
    assert {("hook", "socket.bind", "loopback", "inet/tcp"),
            ("hook+seccomp", "socket.connect", "loopback", "inet/tcp"),
            ("hook+seccomp", "socket.sendto", "loopback", "inet/udp"),
            ("proc", "socket", "loopback", "tcp"),
            ("proc", "socket", "local", "udp")} <= seen  # its sends went to loopback
    r, _ = audit(*small, "--json", "--strict", kind="loopback", mode="no-isolate",
                 standin=False)
    assert r.returncode == 1
    assert json.loads(r.stdout)["counted"]


def test_a_chat_run_starts_no_helper_and_passes_strict(small):
    """Elsewhere a chat template renders in a helper process of specli's own (issue 55):
    the audited run renders it in its own process, so --strict sees no process start and no
    socket pair."""
    r, _ = audit(*small, "--chat", "--json", "--strict", mode="no-isolate", standin=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["counted"] == [] and not any("template_host" in json.dumps(e)
                                            for e in doc["events"])


def test_a_child_the_hook_cannot_see_is_still_reported(small):
    """python -I ignores PYTHONPATH, so the child runs without the audit hook: its loopback
    connection is reported by seccomp and by the /proc poll, with its pid."""
    r, _ = audit(*small, "--json", kind="child-unhooked", mode="no-isolate", standin=False)
    assert r.returncode == 0, r.stderr
    parent, outcome = planted(r, "child-unhooked")
    assert outcome == "ok"
    doc = json.loads(r.stdout)
    child = [e for e in doc["events"] if e["pid"] != parent and e["scope"] != "process"]
    assert child and {e["source"] for e in child} <= {"proc", "seccomp"}
    assert any(e["source"] == "seccomp" and e["event"] == "connect" and
               e["scope"] == "loopback" for e in child)
    assert any(e["scope"] == "loopback" and e["outcome"] == "ESTABLISHED" and "-I" in e["where"]
               for e in child)


@needs_netns
def test_isolation_really_moves_the_run(small):
    """Outside any test namespace, the loopback connection that works unisolated (above)
    fails in the default, isolated audit: the run is in a namespace of its own."""
    r, _ = audit(*small, "--json", kind="loopback", standin=False)
    assert r.returncode == 0, r.stderr
    _, outcome = planted(r, "loopback")
    assert "Network is unreachable" in outcome
    doc = json.loads(r.stdout)
    assert doc["namespace"]["netns"] != os.readlink("/proc/self/ns/net")
    [e] = [e for e in doc["events"] if e["event"] == "socket.connect"]
    assert e["outcome"] == "ENETUNREACH"


def test_isolation_is_checked_from_outside():
    """The auditor reads the audited process's namespace itself: a process in this one (here,
    the test itself) is refused, whatever it would claim."""
    with pytest.raises(events.AuditError, match="not isolated: the audited process's "
                                                  "network namespace"):
        auditor.Auditor._check_isolated(os.getpid())


def test_audit_must_be_started_as_specli_audit(small):
    """The audited process re-runs the command line: called from another program (here
    typer's test runner), the audit refuses with an AuditError (exit 2) before any work."""
    code = ("from typer.testing import CliRunner; from specli.cli.app import app; "
            f"r = CliRunner().invoke(app, ['audit', *{small!r}]); "
            "print(type(r.exception).__name__, r.exception.exit_code, r.exception)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.startswith("AuditError 2 ") and \
        "was not started as `specli audit ...`" in r.stdout


def test_sockaddr_decoding():
    import socket
    import struct

    inet = struct.pack("=H", 2) + struct.pack(">H", 9) + socket.inet_aton("203.0.113.7") + \
        bytes(8)
    assert events.sockaddr(inet) == ("external", NOWHERE, "inet")
    dns = struct.pack("=H", 2) + struct.pack(">H", 53) + socket.inet_aton("127.0.0.53") + \
        bytes(8)
    assert events.sockaddr(dns) == ("external", "127.0.0.53:53 (DNS)", "inet")
    six = struct.pack("=H", 10) + struct.pack(">H", 80) + bytes(4) + \
        socket.inet_pton(socket.AF_INET6, "::1") + bytes(4)
    assert events.sockaddr(six) == ("loopback", "[::1]:80", "inet6")
    assert events.sockaddr(struct.pack("=H", 1) + b"/run/x.sock\0") == (
        "local", "/run/x.sock", "unix")
    assert events.sockaddr(struct.pack("=H", 0)) is None  # AF_UNSPEC: a disconnect
    unspec = struct.pack("=H", 0) + inet[2:]  # but a datagram sent to it goes to sin_addr
    assert events.sockaddr(unspec, connect=False) == ("external", NOWHERE, "inet")
    assert events.sockaddr(struct.pack("=H", 17) + bytes(18))[0] == "external"  # packet


def test_unpeered_datagram_socket_is_judged_by_what_it_sent():
    def proc(pid):
        return events.NetEvent("socket", "local", pid, 0.0, "0.0.0.0:5000 (bound, no peer)",
                                 "udp", "", "unconnected", "proc")
    loop = events.NetEvent("sendto", "loopback", 1, 0.0, "127.0.0.1:9", "inet", "", None,
                             "seccomp")
    out = verdict.unpeered([proc(1), loop, proc(2)])
    assert [e.scope for e in out if e.source == "proc"] == ["local", "external"]
    assert "destination unknown" in out[2].address


def test_recorder_outcomes(tmp_path):
    """The recorder in a fresh interpreter: a refused loopback connect is ECONNREFUSED and a
    timeout (no errno) is TimeoutError, each on its own event; uninstall stops recording."""
    log = tmp_path / "log.jsonl"
    code = f"""
import socket
from specli.audit._site import sitecustomize as rec
rec.install({str(log)!r})
s = socket.socket(); port = (s.bind(("127.0.0.1", 0)), s.getsockname()[1])[1]; s.close()
try:
    socket.create_connection(("127.0.0.1", port))
except OSError:
    pass
def slow(*a):
    raise TimeoutError("timed out")
try:
    rec._outcome(slow)()
except TimeoutError:
    pass
rec._hook("socket.connect", (socket.socket(), ("203.0.113.7", 9)))
rec._ended(None, TimeoutError())
rec.uninstall()
socket.getaddrinfo("localhost", 80)
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    events = [x for x in lines if "event" in x]
    outcomes = {x["ref"]: x["outcome"] for x in lines if "ref" in x}
    assert [e["event"] for e in events] == ["socket.bind", "socket.getaddrinfo",
                                            "socket.connect", "socket.connect"]
    assert len({e["id"] for e in events}) == 4
    assert [outcomes.get(e["id"]) for e in events] == [None, "ok", "ECONNREFUSED",
                                                       "TimeoutError"]


def test_poll_interval_must_be_positive(pair):
    r = specli("audit", *pair, "--poll-ms", "0")
    assert r.returncode == 2 and r.stderr.startswith("error: --poll-ms")


# --- units ----------------------------------------------------------------------------------

@pytest.mark.parametrize("host, listening, scope", [
    ("127.0.0.1", False, "loopback"), ("127.8.9.10", False, "loopback"),
    ("::1", False, "loopback"), ("::ffff:127.0.0.1", False, "loopback"),
    ("localhost", False, "loopback"), ("api.localhost", False, "external"),
    ("203.0.113.7", False, "external"), ("huggingface.co", False, "external"),
    ("10.0.0.1", False, "external"), ("fe80::1%eth0", False, "external"),
    ("0.0.0.0", True, "external"), ("", True, "external"), ("", False, "local"),
    (None, False, "local"),
])
def test_host_scope(host, listening, scope):
    assert events.host_scope(host, listening) == scope


def test_proc_net_addresses():
    assert poller._hex_addr("0100007F:1F90") == ("127.0.0.1", 8080)
    assert poller._hex_addr("00000000000000000000000001000000:0050") == ("::1", 80)
    mapped, port = poller._hex_addr("0000000000000000FFFF00000100007F:0016")
    assert ipaddress.ip_address(mapped).ipv4_mapped == ipaddress.ip_address("127.0.0.1")
    assert port == 22 and events.host_scope(mapped) == "loopback"


def test_verdict_counts_by_scope():
    ev = [events.NetEvent("socket.connect", s, 1, 0.0) for s in ("loopback", "process")]
    assert verdict.verdict(ev) == (0, [])
    assert verdict.verdict(ev, strict=True)[0] == 1
    inherited = events.NetEvent("socket", "external", 1, 0.0, inherited=True)
    assert verdict.verdict([inherited], strict=True) == (0, [])
    assert verdict.verdict([events.NetEvent("socket.sendto", "external", 1, 0.0)])[0] == 1
    assert verdict.verdict([events.NetEvent("outlived the run", "outlived", 1, 0.0)])[0] == 1


def test_network_environment_redacts(tmp_path):
    env = {"HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "1", "http_proxy": "http://a:b/c@h:1",
           "PATH": str(tmp_path), "HUGGING_FACE_HUB_TOKEN": "y", "NO_PROXY": "localhost",
           "ALL_PROXY": "socks5://tok@h:2", "FTP_PROXY": "u:p@h:3",
           "SPECLI_AUDIT_LOG": str(tmp_path / "audit.jsonl"),
           "SPECLI_AUDIT_ROLE": "audited", "SPECLI_AUDIT_RESULT": str(tmp_path / "result.json")}
    assert environment.network_environment(env) == {
        "HF_HUB_OFFLINE": "1", "HF_TOKEN": "(set, redacted)",
        "HUGGING_FACE_HUB_TOKEN": "(set, redacted)", "NO_PROXY": "localhost",
        "ALL_PROXY": "socks5://***@h:2", "FTP_PROXY": "***@h:3",
        "http_proxy": "http://***@h:1"}


def test_sha256_progress_bar_on_a_terminal(pair, f16):
    """On a pseudo-terminal (util-linux `script`) a model over 32 MiB is hashed behind a
    progress bar on stderr; off one (every test above) there is none."""
    import shlex
    import shutil

    if shutil.which("script") is None:
        pytest.skip("util-linux script is not installed")
    cmd = shlex.join([sys.executable, "-m", "specli", "audit", *pair])
    r = subprocess.run(["script", "-qec", f"stty cols 120 rows 40; {cmd}", "/dev/null"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TERM": "xterm"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"sha256 {os.path.basename(f16)}" in r.stdout  # the bar's label, on the pty


# -- issue 31, item 3: what "proven" may say ----------------------------------------------------

class UnixDaemon:
    """A daemon outside the audited tree, on unix socket paths: what it received."""

    def __init__(self, path: Path):
        import socket
        import threading

        self.path, self.received = str(path), []
        self.stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stream.bind(self.path)
        self.stream.listen()
        self.dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.dgram.bind(self.path + ".dgram")
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._datagrams, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.stream.accept()
            except OSError:
                return
            with c:
                self.received.append(c.recv(100) or b"(connected)")

    def _datagrams(self) -> None:
        while True:
            try:
                self.received.append(self.dgram.recv(100))
            except OSError:
                return

    def close(self) -> None:
        self.stream.close()
        self.dgram.close()
        for p in (self.path, self.path + ".dgram", self.path + ".in"):
            with contextlib.suppress(OSError):
                os.unlink(p)


def unix_audit(small, tmp_path, kind, *flags, mode="isolated"):
    daemon = UnixDaemon(tmp_path / "d.sock")
    try:
        os.environ["SPECLI_TEST_UNIX"] = daemon.path
        r, _ = audit(*small, "--json", *flags, kind=kind, mode=mode, tmp=tmp_path,
                     standin=False)
        time.sleep(0.2)
        return r, daemon.received
    finally:
        os.environ.pop("SPECLI_TEST_UNIX", None)
        daemon.close()


@needs_netns
@pytest.mark.parametrize("kind", ["unix", "unix-dgram", "unix-bind", "unix-race"])
def test_a_unix_socket_path_is_refused_isolated(small, tmp_path, kind):
    """A network namespace does not scope unix sockets with a path: isolated, the auditor
    refuses them (making every network call itself, on what it read once: a destination
    rewritten by another thread meanwhile is never used). Listed as local; with --strict,
    counted."""
    r, received = unix_audit(small, tmp_path, kind)
    assert r.returncode == 0, r.stderr
    assert received == [], received  # nothing reached the daemon
    assert not (tmp_path / "d.sock.in").exists()  # nor could anyone connect in
    _, outcome = planted(r, kind)
    assert outcome != "ok"
    doc = json.loads(r.stdout)
    assert doc["isolated"] is True and doc["counted"] == []
    if kind != "unix-race":  # (the race may read only the abstract address each time)
        assert any(e["scope"] == "local" and (e["outcome"] or "").startswith("refused")
                   and "seccomp" in e["source"] for e in doc["events"]), doc["events"]
    if kind == "unix":  # the refused attempt counts with --strict
        r, received = unix_audit(small, tmp_path, kind, "--strict")
        assert received == [] and r.returncode == 1 and json.loads(r.stdout)["counted"]


@needs_netns
def test_a_unix_socket_path_is_observed_unisolated(small, tmp_path):
    r, received = unix_audit(small, tmp_path, "unix", mode="no-isolate")
    assert r.returncode == 0 and received == [b"secret"]  # real, and listed
    doc = json.loads(r.stdout)
    assert any(e["scope"] == "local" and e["address"].endswith("d.sock")
               for e in doc["events"])


@needs_standin
def test_a_program_started_is_recorded_whatever_the_log_says(small, tmp_path):
    """The recorder's log is writable by the audited process: the plant starts a program and
    erases the log. The start is still counted under --strict (the auditor saw the execve)."""
    r, _ = audit(*small, "--json", "--strict", kind="hidden-start", tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert any(e["scope"] == "process" and e["source"] == "seccomp" and "true" in e["address"]
               for e in doc["counted"]), doc["counted"]


@needs_standin
@pytest.mark.parametrize("kind", ["auditor-thread", "auditor-fork"])
def test_code_from_the_environment_in_the_auditor(small, tmp_path, kind):
    """A sitecustomize that stays quiet in the audited run and connects from specli audit's
    own interpreter, later. The auditor re-executes itself (-I -S) before it watches: the
    thread ends there, a process it forked is killed and counted; and since that code ran,
    the verdict is no proof: exit 2, or, with --allow-unproven, an observation."""
    r, received = audit(*small, kind=kind, tmp=tmp_path)  # (with --allow-unproven)
    assert received["received"] == [], received
    assert "code from the environment ran in specli audit" in r.stdout
    if kind == "auditor-fork":
        assert r.returncode == 1 and "started before the audit" in r.stdout, r.stdout
    else:
        assert r.returncode == 0, r.stderr
        assert "verdict: clean, observed (not a proof: see above" in r.stdout


@needs_standin
def test_code_from_the_environment_refuses_a_proof(small, tmp_path):
    out = tmp_path / "standin.json"
    env = {**os.environ, "SPECLI_TEST_PLANT": "auditor-thread",
           "PYTHONPATH": os.pathsep.join([str(TESTS / "plant"), str(ROOT)])}
    r = subprocess.run(["unshare", "--net", "--mount", sys.executable, str(TESTS / "standin.py"),
                        str(out), sys.executable, "-m", "specli", "audit", *small],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if not x.startswith("plant:")]
    assert len(lines) == 1 and "code from the environment ran in specli audit" in lines[0]
    assert "sitecustomize" in lines[0] and "--allow-unproven" in lines[0]
    assert json.loads(out.read_text())["received"] == []


@needs_netns
@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_a_socket_on_stdout_is_no_proof(small, tmp_path, kind):
    """stdout handed in as a socket: what the run writes there (a plant writes to fd 1)
    reaches whoever listens. Isolated: exit 2 before any work; observed: counted by peer."""
    import socket

    if kind == "tcp":
        srv = socket.create_server(("127.0.0.1", 0))
        out = socket.create_connection(srv.getsockname())
    else:
        out, peer = socket.socketpair()
    try:
        cmd = [sys.executable, "-m", "specli", "audit", *small]
        r = subprocess.run(cmd, stdout=out.fileno(), stderr=subprocess.PIPE, text=True,
                           timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "stdout is a socket" in lines[0] and "--allow-unproven" in lines[0]
        r = subprocess.run([*cmd, "--no-isolate", "--strict"], stdout=out.fileno(),
                           stderr=subprocess.PIPE, text=True, timeout=120)
        assert r.returncode == 1, r.stderr  # a loopback or local peer: counted with --strict
    finally:
        out.close()
        if kind == "tcp":
            srv.close()
        else:
            peer.close()


@needs_netns
def test_the_run_cannot_reach_into_other_processes(small, tmp_path):
    """Same uid, outside the namespace: its /proc/PID/mem would let the run make that process
    connect for it. A user namespace of its own already forbids that; root where user
    namespaces are off (the fallback, made here by refusing them) did not: now the run drops
    CAP_SYS_PTRACE and is in a Landlock domain."""
    if not boot.landlock_abi() or os.geteuid() != 0:
        pytest.skip("this kernel has no Landlock, or the fallback (root's) cannot be made")
    # the target holds no capability (root's processes are shielded by theirs, a user's not)
    drop = ("import ctypes, time; libc = ctypes.CDLL(None); "
            "head = (ctypes.c_uint32 * 2)(0x20080522, 0); data = (ctypes.c_uint32 * 6)(); "
            "assert libc.capset(head, data) == 0; print('ready', flush=True); time.sleep(60)")
    target = subprocess.Popen([sys.executable, "-c", drop], stdout=subprocess.PIPE, text=True)
    assert target.stdout.readline().strip() == "ready"
    env = {**os.environ, "SPECLI_TEST_PLANT": "proc-mem", "SPECLI_TEST_TARGET": str(target.pid),
           "PYTHONPATH": os.pathsep.join([str(TESTS / "plant"), str(ROOT)])}
    try:
        r = subprocess.run([sys.executable, str(TESTS / "deny_unshare.py"), "--user-only",
                            sys.executable, "-m", "specli", "audit", *small, "--json",
                            UNPROVEN], capture_output=True, text=True, timeout=120, env=env)
    finally:
        target.kill()
        target.wait()
    assert r.returncode == 0, r.stderr
    _, outcome = planted(r, "proc-mem")
    assert "Permission denied" in outcome or "not permitted" in outcome, outcome


@needs_netns
def test_root_without_user_namespaces_keeps_no_network_capability(small, tmp_path):
    """Where user namespaces are refused, root falls back to a network namespace alone, and
    drops what would reach the host from there (netlink's CAP_NET_ADMIN, ptrace...)."""
    if os.geteuid() != 0:
        pytest.skip("the fallback is root's")
    cmd = [sys.executable, str(TESTS / "deny_unshare.py"), "--user-only", sys.executable,
           "-m", "specli", "audit", *small, "--json", "--allow-unproven"]
    env = {**os.environ, "SPECLI_TEST_PLANT": "capabilities",
           "PYTHONPATH": os.pathsep.join([str(TESTS / "plant"), str(ROOT)])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "plant: capabilities net_admin=False sys_admin=False" in r.stderr, r.stderr
    assert json.loads(r.stdout)["isolated"] is True


def test_the_import_rule_knows_the_audited_role():
    """audit_boot spells the audited run's role variable itself (it runs before
    site-packages are on the path, and the entry point asks it before loading anything):
    it must be boot's."""
    import inspect

    from specli.cli import audit_boot

    assert f'os.environ.get("{boot.ROLE_ENV}") != "audited"' in inspect.getsource(audit_boot)


@needs_standin
def test_a_run_that_fails_still_gets_its_report(small, tmp_path):
    """A CI smoke test needs the report, and the JSON, in every outcome (issue 59): -hf that
    cannot reach the hub (isolated: its lookup is the attempt that counts) is exit 1 with the
    attempt listed and the run's own error; a run that fails with no network use is exit 2,
    "no verdict", with the report all the same."""
    hub = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": "http://hub.invalid"}
    r, received = audit("-hf", "acme/tiny-GGUF:Q4_K_M", "-p", "hi", "-n", "4", "--json",
                        tmp=tmp_path, env=hub)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "network use seen" and doc["run"] is None and not doc["proof"]
    assert doc["run_error"]["exit_code"] == 2 and doc["run_error"]["message"]
    assert any("hub.invalid" in e["address"] for e in doc["counted"]), doc["counted"]
    assert received["received"] == []  # isolated: nothing got out
    r, _ = audit("-hf", "acme/tiny-GGUF:Q4_K_M", "-p", "hi", "-n", "4", tmp=tmp_path,
                 env=hub)
    assert r.returncode == 1 and "the run failed (exit 2): " in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("verdict: NETWORK USE SEEN")
    r, _ = audit("-m", str(tmp_path / "missing.gguf"), "-p", "hi", "--json", tmp=tmp_path)
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "no verdict: the run failed" and doc["counted"] == []
    assert "missing.gguf" in doc["run_error"]["message"]


@needs_netns
def test_show_text_puts_the_generated_text_in_the_report(small):
    r = specli("audit", *small, "--show-text", "--json")
    assert r.returncode == 0, r.stderr
    text = json.loads(r.stdout)["text"]
    plain = specli("run", *small)
    assert text and plain.stdout.startswith(text)  # run's stdout: the text (and a newline)
    r = specli("audit", *small, "--show-text")
    assert r.returncode == 0 and "[ generated text ]" in r.stdout
    assert "text" not in json.loads(specli("audit", *small, "--json").stdout)

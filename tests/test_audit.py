"""specli audit on the real SmolLM2 pair: a clean run, planted attempts, --isolate.

Every attempt aimed at a non-loopback address is planted (tests/plant_audit.py) in a process
started inside `unshare --net`, a fresh network namespace: nothing can leave the machine.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import specli

from specli import netguard

PLANT = str(Path(__file__).with_name("plant_audit.py"))
NOWHERE = "203.0.113.7:9"


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


needs_netns = pytest.mark.skipif(not _can_unshare(),
                                 reason="unshare --net is not permitted: planted attempts need "
                                        "a fresh network namespace (root or user namespaces)")


@pytest.fixture(scope="module")
def pair(f16, q4_1) -> list[str]:
    return ["-m", f16, "-md", q4_1, "-p", "Write a sorting algorithm", "-n", "8", "--temp", "0"]


def plant(kind: str, *args: str, netns: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, PLANT, kind, "audit", *args]
    if netns:
        cmd = ["unshare", "--net", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


def planted(r: subprocess.CompletedProcess, kind: str) -> tuple[int, str]:
    """(pid, outcome) the plant reported on stderr."""
    m = re.search(rf"^plant: {kind} pid (\d+): (.*)$", r.stderr, re.M)
    assert m, r.stderr
    return int(m.group(1)), m.group(2)


def sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


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
    assert doc["poll"]["polls"] >= 5 and doc["isolated"] is False  # the thread polled


def test_clean_run_text_report(pair):
    r = specli("audit", *pair, env={"HF_TOKEN": "hf_secret", "HTTPS_PROXY":
                                    "http://user:pw@proxy.example:3128"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "[ models loaded ]" in out and "sha256 " in out
    assert "no external connections" in out and "accepted tokens: " in out
    assert "HF_TOKEN=(set, redacted)" in out and "hf_secret" not in out
    assert "HTTPS_PROXY=http://***@proxy.example:3128" in out and "pw@" not in out
    assert out.rstrip().splitlines()[-1].startswith("verdict: clean")


@needs_netns
@pytest.mark.parametrize("kind, event, proto", [
    ("connect", "socket.connect", "inet/tcp"),
    ("sendto", "socket.sendto", "inet/udp"),
])
def test_planted_socket_attempt_fails_the_audit(pair, kind, event, proto):
    r = plant(kind, *pair, "--json")
    assert r.returncode == 1, r.stderr
    pid, outcome = planted(r, kind)
    assert "Network is unreachable" in outcome
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "network use seen"
    [e] = [e for e in doc["counted"] if e["event"] == event]
    assert (e["address"], e["proto"], e["pid"], e["scope"], e["outcome"], e["source"]) == (
        NOWHERE, proto, pid, "external", "ENETUNREACH", "hook")
    assert e["where"].endswith(f"in _{kind}") and "plant_audit.py" in e["where"]


@needs_netns
def test_planted_dns_lookup_fails_the_audit(pair):
    r = plant("getaddrinfo", *pair, "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    [e] = doc["counted"]
    assert e["event"] == "socket.getaddrinfo"
    assert e["address"] == "specli-audit-plant.invalid:443"
    assert e["outcome"].startswith("name resolution failed")


@needs_netns
def test_planted_attempt_in_a_child_process(pair):
    r = plant("child", *pair, "--json")
    assert r.returncode == 1, r.stderr
    parent, _ = planted(r, "child")
    doc = json.loads(r.stdout)
    [e] = [e for e in doc["counted"] if e["event"] == "socket.connect"]
    assert e["pid"] != parent and e["address"] == NOWHERE and e["outcome"] == "ENETUNREACH"
    [p] = [e for e in doc["events"] if e["scope"] == "process"]
    assert p["event"] == "subprocess.Popen" and p["pid"] == parent
    assert p["address"].startswith(sys.executable) and "create_connection" in p["address"]


@needs_netns
def test_planted_attempt_text_report(pair):
    r = plant("connect", *pair)
    assert r.returncode == 1
    assert f"socket.connect {NOWHERE} (inet/tcp) -> ENETUNREACH" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("verdict: NETWORK USE SEEN")


def test_loopback_is_reported_and_fails_only_with_strict(pair):
    r = plant("loopback", *pair, "--json", netns=False)  # loopback never leaves the machine
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counted"] == []
    seen = {(e["source"], e["event"], e["scope"], e["proto"]) for e in doc["events"]}
    assert {("hook", "socket.bind", "loopback", "inet/tcp"),
            ("hook", "socket.connect", "loopback", "inet/tcp"),
            ("hook", "socket.sendto", "loopback", "inet/udp"),
            ("proc", "socket", "loopback", "tcp"),
            ("proc", "socket", "local", "udp")} <= seen  # the UDP socket has no peer
    r = plant("loopback", *pair, "--json", "--strict", netns=False)
    assert r.returncode == 1
    assert json.loads(r.stdout)["counted"]


def test_proc_poll_sees_a_child_the_hook_cannot(pair):
    """python -I ignores PYTHONPATH, so the child runs without the audit hook: its loopback
    connection (held 0.4 s) is reported by the /proc poll of the process tree, with its pid."""
    r = plant("child-unhooked", *pair, "--json", netns=False)
    assert r.returncode == 0, r.stderr
    parent, outcome = planted(r, "child-unhooked")
    assert outcome == "ok"
    doc = json.loads(r.stdout)
    child = [e for e in doc["events"] if e["pid"] != parent]
    assert child and all(e["source"] == "proc" for e in child)
    assert any(e["scope"] == "loopback" and e["outcome"] == "ESTABLISHED" and "-I" in e["where"]
               for e in child)


@needs_netns
def test_isolate_makes_the_attempt_fail_and_reports_it(pair):
    r = plant("connect", *pair, "--isolate", "--json")
    assert r.returncode == 1, r.stderr
    _, outcome = planted(r, "connect")
    assert "Network is unreachable" in outcome
    doc = json.loads(r.stdout)
    assert doc["isolated"] is True
    assert doc["namespace"]["interfaces"] == ["lo (down)"]
    [e] = [e for e in doc["counted"] if e["event"] == "socket.connect"]
    assert e["outcome"] == "ENETUNREACH"


@needs_netns
def test_isolate_really_moves_the_run(pair):
    """Outside any test namespace, the loopback connection that works unisolated (see
    test_loopback_...) fails under --isolate: the run is in a namespace of its own."""
    r = plant("loopback", *pair, "--isolate", "--json", netns=False)
    assert r.returncode == 0, r.stderr
    _, outcome = planted(r, "loopback")
    assert "Network is unreachable" in outcome
    doc = json.loads(r.stdout)
    assert doc["namespace"]["netns"] != os.readlink("/proc/self/ns/net")
    [e] = [e for e in doc["events"] if e["event"] == "socket.connect"]
    assert e["outcome"] == "ENETUNREACH"


@needs_netns
def test_isolate_clean_run(pair):
    r = specli("audit", *pair, "--isolate", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["isolated"] and doc["events"] == []


@pytest.mark.skipif(os.listdir("/sys/class/net") == ["lo"], reason="this host has only lo")
def test_isolation_claim_is_checked_not_trusted(pair):
    r = specli("audit", *pair, "--isolate", env={netguard.ISOLATED_ENV: "network namespace"})
    assert r.returncode == 2
    assert r.stderr.startswith("error: not isolated: this network namespace has ")
    assert "Traceback" not in r.stderr


# run as `python -m specli.netguard` runs: `import specli` then loads no llama.cpp (whose numpy
# would start a BLAS thread in a process that must stay single-threaded)
SHIM = "import sys; sys.orig_argv[1:3] = ['-m', 'specli.netguard']; "


def test_isolation_refused_is_exit_2(tmp_path):
    """Where unshare is not permitted (a fake unshare: this machine permits it), the
    bootstrap says so in one line and exits 2; it never runs the command unisolated."""
    marker = tmp_path / "ran"
    code = (SHIM + "import errno, specli.netguard as g; g._unshare = lambda f: errno.EPERM; "
            f"g._bootstrap(['/usr/bin/touch', {str(marker)!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("error: network isolation is not permitted here: "
                               "unshare(CLONE_NEWNET): Operation not permitted")
    assert len(r.stderr.strip().splitlines()) == 1 and not marker.exists()


def test_isolation_needs_a_single_thread():
    code = (SHIM + "import threading, time, specli.netguard as g; "
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); "
            "g.enter_namespace()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1 and "AuditError: cannot isolate: this process already runs 2 " \
        "threads" in r.stderr


def test_recorder_outcomes(tmp_path):
    """The recorder in a fresh interpreter: a refused loopback connect is ECONNREFUSED and a
    timeout (no errno) is TimeoutError, each on its own event; uninstall stops recording."""
    log = tmp_path / "log.jsonl"
    code = f"""
import socket
from specli._audit_site import sitecustomize as rec
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
    assert netguard.host_scope(host, listening) == scope


def test_proc_net_addresses():
    assert netguard._hex_addr("0100007F:1F90") == ("127.0.0.1", 8080)
    assert netguard._hex_addr("00000000000000000000000001000000:0050") == ("::1", 80)
    mapped, port = netguard._hex_addr("0000000000000000FFFF00000100007F:0016")
    assert ipaddress.ip_address(mapped).ipv4_mapped == ipaddress.ip_address("127.0.0.1")
    assert port == 22 and netguard.host_scope(mapped) == "loopback"


def test_verdict_counts_by_scope():
    ev = [netguard.NetEvent("socket.connect", s, 1, 0.0) for s in ("loopback", "process")]
    assert netguard.verdict(ev) == (0, [])
    assert netguard.verdict(ev, strict=True)[0] == 1
    inherited = netguard.NetEvent("socket", "external", 1, 0.0, inherited=True)
    assert netguard.verdict([inherited], strict=True) == (0, [])
    assert netguard.verdict([netguard.NetEvent("socket.sendto", "external", 1, 0.0)])[0] == 1


def test_network_environment_redacts(tmp_path):
    env = {"HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "1", "http_proxy": "http://a:b/c@h:1",
           "PATH": str(tmp_path), "HUGGING_FACE_HUB_TOKEN": "y", "NO_PROXY": "localhost",
           "ALL_PROXY": "socks5://tok@h:2", "FTP_PROXY": "u:p@h:3",
           "SPECLI_AUDIT_LOG": str(tmp_path / "audit.jsonl"),
           "SPECLI_AUDIT_ISOLATED": "network namespace"}
    assert netguard.network_environment(env) == {
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

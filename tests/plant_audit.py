"""Test-only: run the specli CLI with a network attempt planted in the engine's first step.

    python tests/plant_audit.py KIND audit -m T -md D ...

KIND is one of PLANTS. The attempt's own outcome goes to stderr as `plant: KIND pid N: ...`
so that a test can check the audit's report against it. The tests run every plant aimed at a
non-loopback address inside `unshare --net`: nothing can leave the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from specli import engine

NOWHERE = ("203.0.113.7", 9)  # TEST-NET-3 (RFC 5737): documentation only, never routed

CHILD_CONNECT = f"import socket; socket.create_connection({NOWHERE!r}, timeout=2)"
CHILD_HOLD = ("import socket, sys, time; c = socket.create_connection(('127.0.0.1', "
              "int(sys.argv[1]))); time.sleep(0.4); c.close()")


def _connect():
    socket.create_connection(NOWHERE, timeout=2)


def _sendto():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"x", NOWHERE)


def _getaddrinfo():
    socket.getaddrinfo("specli-audit-plant.invalid", 443)


def _child():
    r = subprocess.run([sys.executable, "-c", CHILD_CONNECT], capture_output=True, text=True)
    if r.returncode:
        raise OSError(r.stderr.strip().splitlines()[-1])


def _loopback():
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        c = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
        udp.sendto(b"x", srv.getsockname())  # auto-binds the UDP socket to 0.0.0.0
        time.sleep(0.2)  # long enough for the /proc poll to see every socket
        c.close()
        peer.close()


def _child_unhooked():
    """A child the audit hook cannot see (python -I ignores PYTHONPATH) holds a loopback
    connection: only the /proc poll of the process tree can report it."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        child = subprocess.Popen([sys.executable, "-I", "-c", CHILD_HOLD,
                                  str(srv.getsockname()[1])])
        peer, _ = srv.accept()
        child.wait()
        peer.close()


PLANTS = {"connect": _connect, "sendto": _sendto, "getaddrinfo": _getaddrinfo,
          "child": _child, "loopback": _loopback, "child-unhooked": _child_unhooked}


def main() -> None:
    kind, args = sys.argv[1], sys.argv[2:]
    plant, step, done = PLANTS[kind], engine.Engine._step, []

    def planted(self, *a, **k):
        if not done:
            done.append(1)
            try:
                plant()
                outcome = "ok"
            except OSError as e:
                outcome = f"{type(e).__name__}: {e}"
            print(f"plant: {kind} pid {os.getpid()}: {outcome}", file=sys.stderr, flush=True)
        return step(self, *a, **k)

    engine.Engine._step = planted
    from specli.cli.app import main as specli_main

    sys.argv = ["specli", *args]
    specli_main()


if __name__ == "__main__":
    main()

"""Test-only: run a command where 203.0.113.7 is a local listener standing in for the outside.

    unshare --net --mount python tests/standin.py OUT.json CMD ARGS...

Inside a fresh network and mount namespace (made by unshare: nothing here can reach the real
network), bring lo up with 203.0.113.7 on it, point resolv.conf at it (a bind mount, private
to this namespace), listen on TCP 9, UDP 9 and UDP 53, run the command, and write what the
listeners received to OUT.json: {"rc": N, "received": [...]}. With the command isolated in a
namespace of its own, nothing may arrive.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

HOST = "203.0.113.7"


def main() -> None:
    out, cmd = sys.argv[1], sys.argv[2:]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{HOST}/32", "dev", "lo"], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write(f"nameserver {HOST}\noptions timeout:1 attempts:1\n")
    try:
        subprocess.run(["mount", "--bind", f.name, "/etc/resolv.conf"], check=True)
    finally:
        os.unlink(f.name)  # the mount keeps the file for this namespace; /tmp keeps nothing
    received: list[dict] = []
    lock = threading.Lock()

    def note(kind: str, port: int, peer) -> None:
        with lock:
            received.append({"kind": kind, "port": port, "peer": str(peer), "t": time.time()})

    tcp = socket.create_server((HOST, 9))
    udps = []
    for port in (9, 53):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind((HOST, port))
        udps.append((u, port))

    def serve_tcp():
        while True:
            c, peer = tcp.accept()
            note("tcp", 9, peer)
            c.close()

    def serve_udp(u, port):
        while True:
            data, peer = u.recvfrom(4096)
            note("udp", port, peer)
            if port == 53 and len(data) > 12:  # answer NXDOMAIN at once: a fast resolver
                u.sendto(data[:2] + b"\x81\x83" + data[4:6] + b"\0\0\0\0\0\0" + data[12:], peer)

    for target, args in ((serve_tcp, ()), *((serve_udp, a) for a in udps)):
        threading.Thread(target=target, args=args, daemon=True).start()
    rc = subprocess.run(cmd).returncode
    # what was sent before the command ended is queued at the listeners (loopback delivers
    # in the sender's call): wait until they have taken it all, then a moment for the last
    # one to note it
    listeners = [tcp, *(u for u, _ in udps)]
    deadline = time.monotonic() + 2.0
    while select.select(listeners, [], [], 0)[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    with lock, open(out, "w") as f:
        json.dump({"rc": rc, "received": received}, f)
    sys.exit(rc)


if __name__ == "__main__":
    main()

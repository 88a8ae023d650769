"""A fake Hugging Face Hub over real HTTP on loopback: just the endpoints huggingface_hub calls
to list a repository and download a file (tree listing, resolve with ETag, X-Repo-Commit,
X-Linked-Size, Content-Length and Range). Tests point HF_ENDPOINT at it; nothing reaches the
real hub."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lfs(path: str) -> bool:
    # model files are LFS objects; READMEs and configs are plain git blobs
    return path.endswith((".gguf", ".safetensors"))


@dataclass
class Repo:
    files: dict[str, bytes]
    private: bool = False
    # served instead of the listed bytes (a corrupted mirror): path -> bytes
    tampered: dict[str, bytes] = field(default_factory=dict)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.drops: dict[str, int] = {}  # "repo/path": that many GETs stop mid-body
        self.token = "hf_secret"
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                        daemon=True)  # shut down within 50 ms, not 0.5 s
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes], **kw) -> Repo:
        self.repos[repo] = Repo(dict(files), **kw)
        return self.repos[repo]

    # -- request handling ---------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, dict(h.headers)))
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
        if m:
            return self._tree(h, m.group(1), m.group(3) or "", body)
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
        if m:
            return self._info(h, m.group(1), body)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(h, m.group(1), m.group(3), body)
        self._error(h, 404, "EntryNotFound", "not found", body)

    def _repo(self, h, name: str, body: bool) -> Repo | None:
        repo = self.repos.get(name)
        auth = h.headers.get("Authorization", "")
        if repo is None or (repo.private and auth != f"Bearer {self.token}"):
            # the hub answers 401 for both, so that private repos do not leak their existence
            self._error(h, 401 if repo is not None or not auth else 404, "RepoNotFound",
                        "Repository not found", body)
            return None
        return repo

    def _tree(self, h, name: str, prefix: str, body: bool) -> None:
        repo = self._repo(h, name, body)
        if repo is None:
            return
        entries = [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                    "path": p, **({"lfs": {"oid": hashlib.sha256(data).hexdigest(),
                                           "size": len(data), "pointerSize": 134}}
                                  if _lfs(p) else {})}
                   for p, data in sorted(repo.files.items()) if p.startswith(prefix)]
        self._json(h, entries, body)

    def _info(self, h, name: str, body: bool) -> None:
        repo = self._repo(h, name, body)
        if repo is None:
            return
        self._json(h, {"id": name, "modelId": name, "sha": COMMIT, "private": repo.private,
                       "siblings": [{"rfilename": p} for p in sorted(repo.files)]}, body)

    def _resolve(self, h, name: str, file: str, body: bool) -> None:
        repo = self._repo(h, name, body)
        if repo is None:
            return
        if file not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{file} not found", body)
        listed = repo.files[file]
        data = repo.tampered.get(file, listed)
        # the hub's ETag: the LFS sha256 for large files, the git blob sha1 for the others
        sha = hashlib.sha256(listed).hexdigest() if _lfs(file) else \
            hashlib.sha1(listed).hexdigest()
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng:
            m = re.match(r"bytes=(\d+)-", rng)
            start, status = int(m.group(1)), 206
        h.send_response(status)
        h.send_header("ETag", f'"{sha}"')
        if _lfs(file):
            h.send_header("X-Linked-Etag", f'"{sha}"')
            h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data) - start))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        key = f"{name}/{file}"
        if self.drops.get(key, 0) > 0:  # half the body, then the connection drops
            self.drops[key] -= 1
            end = start + (len(data) - start) // 2
            h.wfile.write(data[start:end])  # returns once the client has taken all but
            h.wfile.flush()  # what the socket buffers hold: the FIN follows those bytes
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(data[start:])

    def _json(self, h, doc, body: bool) -> None:
        raw = json.dumps(doc).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if body:
            h.wfile.write(raw)

    def _error(self, h, status: int, code: str, message: str, body: bool) -> None:
        raw = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if body:
            h.wfile.write(raw)

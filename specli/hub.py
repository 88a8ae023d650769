"""The only module that may open a network connection: GGUF files from Hugging Face.

Everything goes through huggingface_hub (tree listing, hf_hub_download), so files land in the
standard cache every other tool shares, and HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN and
HF_HUB_OFFLINE mean what they mean there. `repo:TAG` resolves as llama.cpp resolves `-hf`:
the tag matched case-insensitively as TAG followed by `.` or `-` in the repository's GGUF model
file names; with no tag, Q4_K_M, then Q8_0, then the first GGUF. Split GGUFs
(`-00001-of-0000N.gguf`) come whole.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from specli.errors import SpecliError, UsageError

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's order when no tag is given
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# GGUF files in model repos that are not the model (llama.cpp's gguf_filename_is_model)
_NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")
# a model repository's draft-head sidecars, by the word in their file names (llama.cpp's
# find_best_mtp/-dspark/-dflash/-eagle3), in the order it infers a type from them
SIDECARS = {"draft-mtp": "mtp-", "draft-dspark": "dspark-", "draft-dflash": "dflash-",
            "draft-eagle3": "eagle3-"}


class HubError(SpecliError):
    """The hub or the cache could not provide a file (exit 2)."""


class AmbiguousTag(HubError):
    """A tag that names more than one model: no cache or network changes that."""


@dataclass(frozen=True)
class Ref:
    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None = None
    sha256: str | None = None  # the LFS object id: what the downloaded bytes must hash to


def parse_ref(text: str) -> Ref:
    """`owner/name[:TAG]`, as llama.cpp's -hf takes it."""
    repo, _, tag = text.strip().partition(":")
    if not _REPO.match(repo):
        raise UsageError(f"not a Hugging Face repository: {text!r}",
                         hint="give owner/name, optionally :QUANT (e.g. "
                              "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M)")
    return Ref(repo, tag or None)


def quiet() -> None:
    """Silence huggingface_hub's own warnings (its retries), for -q."""
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def list_files(repo: str, revision: str | None = None, token: str | None = None,
               cache_dir: str | None = None) -> list[RemoteFile]:
    """Every file of the repository: from the hub, or, offline, from the local cache."""
    if offline():
        return _cached_files(repo, revision, cache_dir)
    unreachable = _unreachable()
    if unreachable:  # seconds, not the library's half a minute of retries
        try:
            return _cached_files(repo, revision, cache_dir)
        except HubError:
            raise HubError(f"cannot reach the Hub ({unreachable}); cached files of {repo}: "
                           "none", hint="check the network or HF_ENDPOINT; set "
                           "HF_HUB_OFFLINE=1 to use the cache only") from None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.hf_api import RepoFile

    try:
        tree = HfApi(endpoint=_endpoint(), token=token).list_repo_tree(
            repo, recursive=True, revision=revision)
        files = [RemoteFile(f.path, f.size, f.lfs.sha256 if f.lfs else None)
                 for f in tree if isinstance(f, RepoFile)]
    except HfHubHTTPError as e:  # the hub answered: no
        raise _hub_error(e, repo) from None
    except Exception as e:  # noqa: BLE001 - unreachable: the cache, as llama.cpp falls back
        try:
            return _cached_files(repo, revision, cache_dir)
        except HubError:
            raise _hub_error(e, repo) from None
    for f in files:
        safe_name(f.path, repo)
    return files


def safe_name(path: str, repo: str) -> str:
    """A file name from the hub's listing, refused unless it stays inside the folder it is
    written to: a hostile or broken mirror (HF_ENDPOINT) chooses these names, and neither
    --local-dir nor the sha256 it also supplies would stop `../../x` or `/etc/x`."""
    parts = path.split("/")
    if (not path or "\\" in path or len(path) > 1024 or any(p in ("", ".", "..") for p in parts)
            or any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in path)):  # NUL, ESC...
        shown = path[:80].encode("unicode_escape").decode() + ("..." if len(path) > 80 else "")
        why = "holds control characters" if path and not any(
            p in ("", ".", "..") for p in parts) and "\\" not in path and len(path) <= 1024 \
            else "would be written outside the download folder"
        raise HubError(f"the hub listed an unsafe file name in {repo}: '{shown}' {why}; "
                       "nothing was written",
                       hint="check HF_ENDPOINT: a mirror that lists such names is broken or "
                       "hostile")
    return path


_ETAG = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hub's host cannot be reached (name resolution or connection), or None. Skipped
    behind a proxy, which alone knows the way."""
    import socket
    import threading
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    url = urlsplit(_endpoint() or "https://huggingface.co")
    host, port = url.hostname or "", url.port or (80 if url.scheme == "http" else 443)
    proxies = getproxies()  # the environment's, or the system's (macOS, Windows)
    if any(proxies.get(k) for k in (url.scheme, "all")) and not proxy_bypass(host):
        return None
    found: list = []

    def resolve() -> None:  # getaddrinfo has no timeout of its own
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            found.append(e)

    t = threading.Thread(target=resolve, daemon=True)
    t.start()
    t.join(timeout)
    if not found:
        return f"resolving {host} took over {timeout:g} s"
    if isinstance(found[0], OSError):
        return f"name resolution failed for {host}"
    last = None
    for family, kind, proto, _, addr in found[0][:4]:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout)
                s.connect(addr)
                return None
        except OSError as e:
            last = e
    return f"cannot connect to {host}:{port}: {getattr(last, 'strerror', None) or last}"


def _cached_files(repo: str, revision: str | None, cache_dir: str | None) -> list[RemoteFile]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(cache_dir)
    except CacheNotFound:
        cache = None
    except (OSError, ValueError) as e:  # a file for a folder, a refs file that is not text
        where = cache_dir or os.environ.get("HF_HUB_CACHE") or "the Hugging Face cache"
        raise HubError(f"cannot read {where}: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}"[:300],
                       hint="point HF_HUB_CACHE at a Hugging Face cache folder") from None
    for r in cache.repos if cache else ():
        if r.repo_id == repo and r.repo_type == "model":
            want = revision or "main"
            revs = [v for v in r.revisions if v.commit_hash == want or want in v.refs]
            if revs:
                v = revs[0]
                return [RemoteFile(f.file_path.relative_to(v.snapshot_path).as_posix(),
                                   f.size_on_disk) for f in v.files]
    raise HubError(f"{repo} is not in the local cache and HF_HUB_OFFLINE is set",
                   hint="download it once online, or unset HF_HUB_OFFLINE")


def is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(x in name for x in _NOT_MODEL)


def split_parts(path: str, files: Sequence[str]) -> list[str]:
    """All parts of a split GGUF, given any file name; [path] when it is not split."""
    m = _SPLIT.search(path)
    if not m:
        return [path]
    stem, count = path[:m.start()], int(m.group(2))
    parts = [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    present = {f.lower(): f for f in files}
    missing = [p for p in parts if p.lower() not in present]
    if missing:
        raise HubError(f"split GGUF {path} is incomplete in the repository: "
                       f"{len(missing)} of {count} parts missing (first: {missing[0]})")
    return [present[p.lower()] for p in parts]


def choose(files: Sequence[str], tag: str | None, repo: str = "") -> list[str]:
    """The model file (all parts of a split one) that `repo:tag` names, by llama.cpp's rules;
    HubError listing the candidates when nothing or more than one model matches."""
    models = [f for f in files if is_model(f)]
    firsts = [f for f in models if not (m := _SPLIT.search(f)) or int(m.group(1)) == 1]
    if not firsts:
        raise HubError(f"no GGUF model files in {repo or 'the repository'}"
                       + _listing(files, "files"))
    for t in [tag] if tag else DEFAULT_TAGS:
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        hits = [f for f in firsts if pattern.search(f)]
        # llama.cpp takes the first hit; of several, keep those where the tag starts a
        # name part (F16 is not BF16)
        bounded = re.compile(r"(?<![A-Za-z0-9])" + pattern.pattern, re.IGNORECASE)
        hits = [f for f in hits if bounded.search(f)] or hits
        if len(hits) == 1:
            return split_parts(hits[0], files)
        if len(hits) > 1:
            raise AmbiguousTag(f"{repo}:{t} is ambiguous: it matches {len(hits)} models"
                               + _listing(hits), hint="name one with --file (-hff)")
    if tag:
        raise HubError(f"no GGUF file in {repo} matches the tag {tag}" + _listing(firsts),
                       hint="tags are quantization names such as Q4_K_M or Q8_0")
    return split_parts(sorted(firsts)[0], files)


def _bits(path: str) -> int:
    """The bits of a file's quantization tag (Q4_K_M: 4, F16: 16; 0 when it has none)."""
    stem = _SPLIT.sub("", path.rsplit("/", 1)[-1])
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = re.search(r"\d+", stem.rsplit("-", 1)[-1]) if "-" in stem else None
    return int(m.group()) if m else 0


def sidecar(files: Sequence[str], model: str | None, word: str,
            tag: str | None = None) -> str | None:
    """The sidecar GGUF whose name has `word` that goes with `model` (llama.cpp's
    find_best_sibling): in the model's folder or one above it, the deepest first, then the
    exact tag, then the nearest quantization (to the tag, else to the model's)."""
    model_dir = (model or "").split("/")[:-1]
    want = int(m.group()) if tag and (m := re.search(r"\d+", tag)) else _bits(model or "")
    best, best_key = None, None
    for f in files:
        if not f.endswith(".gguf") or word not in f:
            continue
        sib_dir = f.split("/")[:-1]
        if sib_dir != model_dir[:len(sib_dir)]:
            continue  # not in a folder on the model's path
        exact = bool(tag) and f"-{tag.upper()}." in f.upper()
        key = (len(sib_dir), exact, -abs(_bits(f) - want))
        if best_key is None or key > best_key:
            best, best_key = f, key
    return best


def fetch_sidecars(ref: Ref, kinds: Sequence[str], revision: str | None = None,
                   token: str | None = None, local_dir: str | None = None,
                   progress: bool = True,
                   on_file: Callable[[str], None] | None = None) -> dict[str, Path]:
    """The draft-head sidecars of these types (SIDECARS' keys) that `ref`'s repository ships
    beside its model, downloaded: {type: local path}; a type it lacks is left out."""
    by_path = {f.path: f for f in list_files(ref.repo, revision, token)}
    try:
        model = choose(list(by_path), ref.tag, ref.repo)[0]
    except HubError:  # sidecars alone: llama.cpp resolves them without a model too
        model = None
    out = {}
    for kind in kinds:
        name = sidecar(list(by_path), model, SIDECARS[kind], ref.tag)
        if name is not None:
            out[kind] = download(ref.repo, [by_path[n] for n in split_parts(name, list(by_path))],
                                 revision, local_dir, token, progress=progress,
                                 on_file=on_file)[0]
    return out


def checkpoint_files(files: Sequence[str]) -> list[str] | None:
    """The files a safetensors head checkpoint's conversion reads (config.json, the index if
    any, the weights at the repository's top level), or None for a repository that is not
    one: llama.cpp's converter reads nothing else (no tokenizer: the target's GGUF has it)."""
    top = {f for f in files if "/" not in f}
    weights = sorted(f for f in top if f.startswith("model") and f.endswith(".safetensors"))
    if "config.json" not in top or not weights:
        return None
    extra = [f for f in ("model.safetensors.index.json", "mask_embedding.pt") if f in top]
    return ["config.json", *extra, *weights]  # a mask_embedding.pt only to be refused


def checkpoint_listing(ref: Ref, revision: str | None = None, token: str | None = None
                       ) -> dict[str, RemoteFile] | None:
    """The repository's files if it publishes a head as a safetensors checkpoint, with no
    GGUF model to take instead (for fetch_checkpoint, which then lists nothing again)."""
    by_path = {f.path: f for f in list_files(ref.repo, revision, token)}
    names = list(by_path)
    return by_path if checkpoint_files(names) is not None and not any(
        map(is_model, names)) else None


def fetch_checkpoint(ref: Ref, revision: str | None = None, token: str | None = None,
                     progress: bool = True, on_file: Callable[[str], None] | None = None,
                     listing: dict[str, RemoteFile] | None = None) -> tuple[Path, str, Path]:
    """A head checkpoint's files, downloaded into the cache (or found there offline):
    (its snapshot folder, the commit it is, the repository's folder in the cache, which the
    snapshot's links lead into)."""
    by_path = listing or {f.path: f for f in list_files(ref.repo, revision, token)}
    names = checkpoint_files(list(by_path))
    if names is None:
        raise HubError(f"{ref.repo} has no draft head: no *.gguf sidecar, and no config.json "
                       "with *.safetensors weights" + _listing(list(by_path), "files"))
    paths = download(ref.repo, [by_path[n] for n in names], revision, None, token,
                     progress=progress, on_file=on_file)
    snapshot = paths[0].parent
    return snapshot, snapshot.name, snapshot.parent.parent


def _listing(names: Sequence[str], what: str = "candidates") -> str:
    shown = sorted(names)[:20]
    more = f", ... ({len(names) - 20} more)" if len(names) > 20 else ""
    return f"; {what}: {', '.join(shown)}{more}" if names else ""


def download(repo: str, files: Sequence[RemoteFile], revision: str | None = None,
             local_dir: str | None = None, token: str | None = None,
             cache_dir: str | None = None, progress: bool = True,
             on_file: Callable[[str], None] | None = None) -> list[Path]:
    """Download (or find in the cache) each file; each is checked against the hub's sha256
    before it is returned, and a mismatch deletes it. An interrupted download resumes where
    it stopped on the next call (huggingface_hub's .incomplete files)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if progress else disable_progress_bars)()
    if revision is not None and (revision.startswith("/") or "\\" in revision
                                 or any(p in ("", ".", "..") for p in revision.split("/"))):
        raise UsageError(f"not a revision: {revision!r}", hint="a branch, tag or commit")
    paths = []
    for f in files:
        safe_name(f.path, repo)
    for f in files:
        if on_file:
            on_file(f.path)
        try:
            if local_dir is not None and not offline():
                p, _ = _fetch_blob(repo, f, revision, token, cache_dir, local_dir)
            elif not offline():
                # linked into the snapshot here, not by hf_hub_download: it would ask the
                # mirror again and trust its second answer (an ETag, a commit) as a path
                blob, commit = _fetch_blob(repo, f, revision, token, cache_dir)
                p = _link(blob, commit, f.path, revision)
            else:  # offline: the cache's own file
                p = Path(hf_hub_download(repo, f.path, revision=revision, local_dir=local_dir,
                                         token=token, cache_dir=cache_dir,
                                         endpoint=_endpoint()))
        except HubError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _hub_error(e, repo, f.path) from None
        paths.append(p)
    return paths


def _link(blob: Path, commit: str, name: str, revision: str | None) -> Path:
    """The blob as the cache's snapshots/COMMIT/NAME (a relative symlink, as huggingface_hub
    makes it; a copy where links are refused), and refs/REVISION naming the commit."""
    storage = blob.parent.parent
    pointer = storage / "snapshots" / commit / name
    if not pointer.exists():
        pointer.parent.mkdir(parents=True, exist_ok=True)
        tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(os.path.relpath(blob, pointer.parent), tmp)
        except OSError:
            import shutil

            shutil.copyfile(blob, tmp)
        os.replace(tmp, pointer)
    rev = revision or "main"
    if rev != commit:
        ref = storage / "refs" / rev
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return pointer


def _fetch_blob(repo: str, f: RemoteFile, revision: str | None, token: str | None,
                cache_dir: str | None, local_dir: str | None = None) -> tuple[Path, str]:
    """Download one file into the cache's blob store (or, with local_dir, to its place
    there), resumably: the bytes go to a `.incomplete` file, kept when the transfer fails or
    is interrupted, and the next call asks for the rest with a Range request
    (huggingface_hub 2 restarts from zero in a new temporary file instead). The file is
    checked against the hub's sha256 before it gets its final name; in the cache,
    hf_hub_download then only links the blob into the snapshot."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(repo, f.path, revision=revision, endpoint=_endpoint())
    meta = get_hf_file_metadata(url, token=token, endpoint=_endpoint())
    etag = meta.etag or hashlib.sha256(url.encode()).hexdigest()
    commit = meta.commit_hash or ""
    for what, value, ok in (("an ETag", etag, _ETAG.match(etag)),
                            ("a commit", commit, local_dir is not None or _COMMIT.match(commit))):
        if not ok:  # each names a file or a folder on disk
            raise HubError(f"the hub answered {repo}/{f.path} with {what} that is no hash "
                           f"({value[:40].encode('unicode_escape').decode()!r}): nothing was "
                           "written", hint="check HF_ENDPOINT: a mirror that answers so is "
                           "broken or hostile")
    if local_dir is None:
        storage = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(
            repo_id=repo, repo_type="model")
        blob = storage / "blobs" / etag
        partial = blob.with_name(blob.name + ".incomplete")
    else:  # --local-dir: the file itself, its partial kept beside, as resumable
        blob = Path(local_dir) / f.path
        partial = Path(local_dir) / ".cache" / "specli" / (
            f.path.replace("/", "--") + f".{etag}.incomplete")

    def done() -> bool:  # in the cache a blob is named by its etag; a local file is not
        return blob.exists() and (local_dir is None or meta.size is None
                                  or blob.stat().st_size == meta.size)

    if done():
        return blob, commit
    partial.parent.mkdir(parents=True, exist_ok=True)
    target = meta.location or url
    # the hub's own token never goes to the storage host a download redirects to
    same_host = urlparse(target).netloc == urlparse(url).netloc
    headers = build_hf_headers(token=token) if same_host else {}
    with WeakFileLock(partial.with_name(partial.name + ".lock")):  # one writer per partial
        if done():
            return blob, commit
        if meta.size is not None and partial.exists() and partial.stat().st_size > meta.size:
            partial.unlink()  # longer than the file: not a prefix of it, start over
        with open(partial, "ab") as fh:
            have = fh.tell()
            if meta.size is None or have < meta.size:
                http_get(target, fh, resume_size=have, headers=headers,
                         expected_size=meta.size, displayed_filename=f.path.rsplit("/", 1)[-1])
        if f.sha256:
            _verify(partial, f.sha256, repo, f.path)
        elif meta.size is not None and partial.stat().st_size != meta.size:
            partial.unlink()
            raise HubError(f"{repo}/{f.path}: got a different size than the hub lists: the "
                           "partial was deleted", hint="download it again")
        blob.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, blob)
    return blob, commit


def _verify(path: Path, sha256: str, repo: str, name: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != sha256:
        real = path.resolve()
        path.unlink(missing_ok=True)
        if real != path:
            real.unlink(missing_ok=True)
        raise HubError(f"{repo}/{name}: sha256 mismatch (got {h.hexdigest()[:16]}..., the hub "
                       f"lists {sha256[:16]}...): the damaged file was deleted",
                       hint="download it again")


def _hub_error(e: Exception, repo: str, file: str | None = None) -> HubError:
    from huggingface_hub import errors

    what = f"{repo}/{file}" if file else repo
    if isinstance(e, errors.GatedRepoError):
        return HubError(f"{repo} is gated: accept its terms on huggingface.co",
                        hint="then set HF_TOKEN (or pass --hf-token)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"repository not found (or private): {repo}",
                        hint="check the name; for a private repo set HF_TOKEN")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"revision not found in {repo}")
    if isinstance(e, errors.LocalEntryNotFoundError):  # (a subclass of EntryNotFoundError)
        return HubError(f"{what} is not in the local cache"
                        + (" and HF_HUB_OFFLINE is set" if offline() else
                           " and the hub could not be reached"),
                        hint="download it once online" if offline() else
                        "check the network or HF_ENDPOINT; run again to resume")
    if isinstance(e, errors.EntryNotFoundError):
        return HubError(f"file not found: {what}")
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return HubError(f"the hub refused {what} (HTTP {status})" if status else
                        f"the hub failed for {what}: {str(e).splitlines()[0]}")
    return HubError(f"could not download {what}: {type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}",
                    hint="run again to resume where it stopped")


# -- pair presets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Pair:
    name: str
    target: Ref
    draft: Ref  # a draft model's GGUF, or (head) a head's safetensors checkpoint
    note: str
    head: str | None = None  # the head's --spec-type, when the draft is a head checkpoint


def pairs() -> list[Pair]:
    """The seeds' recommended draft/target pairs, and the published heads for their targets
    (specli/pairs.toml)."""
    doc = tomllib.loads(resources.files("specli").joinpath("pairs.toml").read_text())
    return [Pair(name, parse_ref(p["target"]), parse_ref(p.get("draft") or p["head"]),
                 p.get("note", ""), p.get("spec_type") if "head" in p else None)
            for name, p in doc["pair"].items()]


def pair(name: str) -> Pair:
    for p in pairs():
        if p.name == name:
            return p
    raise UsageError(f"unknown pair preset {name!r}",
                     hint="specli download --list-pairs shows them: "
                          + ", ".join(p.name for p in pairs()))


def fetch(ref: Ref, file: str | None = None, revision: str | None = None,
          token: str | None = None, local_dir: str | None = None, progress: bool = True,
          on_file: Callable[[str], None] | None = None) -> list[Path]:
    """The model `ref` (or its `file`) as local paths, the first part of a split model first."""
    files = list_files(ref.repo, revision, token)
    by_path = {f.path: f for f in files}
    ggufs = [f for f in by_path if f.lower().endswith(".gguf")]
    try:
        if file is not None:
            if file not in by_path:
                raise HubError(f"file not found: {ref.repo}/{file}" + _listing(ggufs,
                                                                               "GGUF files"))
            names = split_parts(file, list(by_path))
        else:
            names = choose(list(by_path), ref.tag, ref.repo)
    except AmbiguousTag:
        raise
    except HubError:
        if offline():  # the cache is all there is: say so, rather than "no such file"
            what = f"{ref.repo}/{file}" if file else str(ref)
            raise HubError(f"{what} is not in the local cache and HF_HUB_OFFLINE is set"
                           + _listing(ggufs, "cached"),
                           hint="download it once online, or unset HF_HUB_OFFLINE") from None
        raise
    return download(ref.repo, [by_path[n] for n in names], revision, local_dir, token,
                    progress=progress, on_file=on_file)

"""llama.cpp's ngram-cache and its lookup-cache files (common/ngram-cache.cpp, examples/lookup).

A cache maps an n-gram of 1 to 4 tokens to the tokens that followed it and how often. Drafting
consults three: the context cache (built from this generation's text, lax thresholds), the
dynamic cache (-lcd: earlier generations, strict thresholds) and the static cache (-lcs: a
corpus, bigrams only), which also re-weights the other two's candidates.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.drafts.base import DraftSource
from specli.drafts.tree import Tree
from specli.errors import SpecliError

if TYPE_CHECKING:
    from specli.rules import Rules

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2  # LLAMA_NGRAM_MIN / _MAX / _STATIC
NULL = -1  # LLAMA_TOKEN_NULL pads n-grams shorter than NGRAM_MAX
INT32_MAX = 2**31 - 1  # counts saturate here in a file

# a draft stops when the best continuation has fewer samples or a lower share than these,
# indexed by n-gram size - 1 (llama.cpp's draft_min_sample_size/percent)
MIN_SAMPLES_LAX, MIN_PERCENT_LAX = (2, 2, 1, 1), (66, 50, 50, 50)
MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT = (4, 3, 2, 2), (75, 66, 66, 66)

Ngram = tuple[int, int, int, int]
Cache = dict[Ngram, dict[int, int]]


class LookupCacheError(SpecliError):
    """A lookup-cache file that is missing, corrupt, or not a lookup cache."""


def _ngram(tokens: Sequence[int], start: int, size: int) -> Ngram:
    g = list(tokens[start:start + size])
    return tuple(g + [NULL] * (NGRAM_MAX - size))  # type: ignore[return-value]


def update(cache: Cache, tokens: Sequence[int], n_new: int, ngram_min: int = NGRAM_MIN,
           ngram_max: int = NGRAM_MAX) -> None:
    """Count, for every n-gram size, what followed each n-gram ending in the last n_new tokens
    (common_ngram_cache_update)."""
    size = len(tokens)
    for n in range(ngram_min, ngram_max + 1):
        for i in range(max(size - n_new, n), size):
            part = cache.setdefault(_ngram(tokens, i - n, n), {})
            t = tokens[i]
            part[t] = part.get(t, 0) + 1


def merge(target: Cache, add: Cache) -> None:
    """Add the counts of `add` into `target` (common_ngram_cache_merge)."""
    for ngram, part in add.items():
        merged = target.get(ngram)
        if merged is None:
            target[ngram] = dict(part)
            continue
        for t, c in part.items():
            merged[t] = merged.get(t, 0) + c


def _try_static(static: Cache, ngram: Ngram) -> int:
    part = static.get(ngram)
    if not part:
        return NULL
    best, best_count, total = NULL, 0, 0
    for t, c in reversed(part.items()):  # ties go to the newest, as in _try_primary
        if c > best_count:
            best, best_count = t, c
        total += c
    if total < MIN_SAMPLES_LAX[NGRAM_STATIC - 1]:
        return NULL
    if 100 * best_count < MIN_PERCENT_LAX[NGRAM_STATIC - 1] * total:
        return NULL
    return best


def _try_primary(primary: Cache, ngrams: list[Ngram], static_part: dict[int, int],
                 min_samples: Sequence[int], min_percent: Sequence[int]) -> int:
    """The longest n-gram whose best continuation (weighted by the static cache) is frequent
    and dominant enough."""
    for i in range(len(ngrams) - 1, -1, -1):
        part = primary.get(ngrams[i])
        if part is None:
            continue
        best, best_primary, best_static, total = NULL, 0, 0, 0
        for t, c in reversed(part.items()):  # ties go to the newest, as in libstdc++ maps
            s = 100 * static_part[t] if t in static_part else 1
            if c * s > best_primary * best_static:
                best, best_primary, best_static = t, c, s
            total += c
        if total < min_samples[i] or 100 * best_primary < min_percent[i] * total:
            continue
        return best
    return NULL


def draft(history: Sequence[int], n_draft: int, context: Cache, dynamic: Cache,
          static: Cache, ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> list[int]:
    """Up to n_draft tokens to follow `history`, one at a time, each drafted token becoming part
    of the n-grams for the next (common_ngram_cache_draft)."""
    if len(history) < NGRAM_STATIC:
        return []
    seq = list(history[-ngram_max:]) if len(history) >= ngram_max else list(history)
    out: list[int] = []
    while len(out) < n_draft:
        static_part = static.get(_ngram(seq, len(seq) - NGRAM_STATIC, NGRAM_STATIC), {})
        ngrams = [_ngram(seq, len(seq) - n, n) for n in range(ngram_min, ngram_max + 1)
                  if n <= len(seq)]
        token = _try_primary(context, ngrams, static_part, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
        if token == NULL:
            token = _try_primary(dynamic, ngrams, static_part, MIN_SAMPLES_STRICT,
                                 MIN_PERCENT_STRICT)
        if token == NULL:
            token = _try_static(static, _ngram(seq, len(seq) - NGRAM_STATIC, NGRAM_STATIC))
        if token == NULL:
            break
        out.append(token)
        seq.append(token)
    return out


# -- files: llama.cpp's format, native-endian int32 records -------------------------------------
#   ngram: 4 x int32 (NULL-padded) | n: int32 > 0 | n x (token: int32, count: int32 > 0)

def load(path: str | os.PathLike, n_vocab: int | None = None) -> Cache:
    """Read a lookup cache; anything that is not one (truncated, garbage, token ids beyond the
    model's vocabulary) is a LookupCacheError naming the file, never a crash."""
    p = Path(path)
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):  # a FIFO or a device would block the read
            raise LookupCacheError(f"cannot read lookup cache {p}: not a regular file")
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                raise _corrupt(p, "it is a GGUF model")
        data = np.fromfile(p, dtype=np.int32)
        size = p.stat().st_size
    except (OSError, ValueError) as e:
        raise LookupCacheError(
            f"cannot read lookup cache {p}: {getattr(e, 'strerror', None) or e}") from None
    if size % 4:
        raise _corrupt(p, f"its size ({size} bytes) is not a whole number of records")
    ints = data.tolist()
    cache: Cache = {}
    limit = n_vocab if n_vocab is not None else 2**31 - 1
    i, end = 0, len(ints)
    while i < end:
        if i + 5 > end:
            raise _corrupt(p, f"truncated record at byte {4 * i}")
        g = tuple(ints[i:i + 4])
        n = ints[i + 4]
        size_n = next((j for j, t in enumerate(g) if t == NULL), NGRAM_MAX)
        if (size_n == 0 or any(t != NULL for t in g[size_n:])
                or any(not 0 <= t < limit for t in g[:size_n])):
            raise _corrupt(p, f"not an n-gram at byte {4 * i}")
        if n <= 0 or i + 5 + 2 * n > end:
            raise _corrupt(p, f"bad continuation count {n} at byte {4 * i + 16}")
        pairs = ints[i + 5:i + 5 + 2 * n]
        toks, counts = pairs[0::2], pairs[1::2]
        if any(not 0 <= t < limit for t in toks) or any(c <= 0 for c in counts):
            raise _corrupt(p, f"bad continuation at byte {4 * i + 20}")
        part: dict[int, int] = {}
        for t, c in zip(toks, counts, strict=True):
            part.setdefault(t, c)  # a repeat keeps the first, as llama.cpp's emplace does
        cache.setdefault(g, part)  # type: ignore[arg-type]
        i += 5 + 2 * n
    return cache


def _corrupt(p: Path, why: str) -> LookupCacheError:
    return LookupCacheError(f"{p} is not a valid lookup cache: {why}",
                            hint="build one with `specli lookup create` (or llama-lookup-create)")


def save(cache: Cache, path: str | os.PathLike) -> None:
    """Write atomically: a temporary file in the same directory, then a rename, so an
    interrupted write leaves the previous file whole."""
    p = Path(path)
    ints: list[int] = []
    for g, part in cache.items():
        if not part:
            continue
        ints.extend(g)
        ints.append(len(part))
        for t, c in part.items():
            ints.extend((t, c))
    p = Path(os.path.realpath(p))  # write through a symlink, as llama.cpp does
    data = np.asarray(ints, dtype=np.int64).clip(max=INT32_MAX).astype(np.int32)  # saturate
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise LookupCacheError(f"cannot write lookup cache {p}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            try:  # keep the mode of the file it replaces; a new one gets the umask's default
                mode = p.stat().st_mode & 0o7777
            except OSError:
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.fchmod(f.fileno(), mode)
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise LookupCacheError(f"cannot write lookup cache {p}: {e.strerror or e}") from e
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def writable(path: str | os.PathLike) -> None:
    """LookupCacheError now if `save` could not write there later: the folder must exist and
    take a new file (tried, which also holds for root and read-only mounts), and the file, if
    there, must be a regular one."""
    p = Path(os.path.realpath(path))
    if p.exists() and not p.is_file():
        raise LookupCacheError(f"cannot write lookup cache {path}: not a regular file")
    if not p.parent.is_dir():
        raise LookupCacheError(f"cannot write lookup cache {path}: no such directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=p.parent)
    except OSError as e:
        raise LookupCacheError(f"cannot write lookup cache {path}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)


def statistics(cache: Cache) -> dict:
    """Sizes of a cache: n-grams by length, distinct continuations, observations."""
    by_size = {n: 0 for n in range(1, NGRAM_MAX + 1)}
    pairs = total = 0
    for g, part in cache.items():
        by_size[next((j for j, t in enumerate(g) if t == NULL), NGRAM_MAX)] += 1
        pairs += len(part)
        total += sum(part.values())
    return {"ngrams": len(cache), "ngrams_by_size": {str(k): v for k, v in by_size.items()},
            "continuations": pairs, "observations": total}


class NgramCache(DraftSource):
    """The ngram-cache draft source, as llama-lookup runs it: the context cache learns every
    committed token; at the end of a generation it is merged into the dynamic cache, which is
    written back (atomically) when it came from a file."""

    name = "ngram-cache"
    # own_length False: llama-lookup drafts up to --draft tokens

    def __init__(self, static: Cache | None = None, dynamic: Cache | None = None,
                 dynamic_path: str | os.PathLike | None = None):
        self.static = static or {}
        self.dynamic = dynamic or {}
        self.dynamic_path = dynamic_path
        self.context: Cache = {}
        self._n_seen = 0  # committed tokens counted in the context cache

    @classmethod
    def from_files(cls, static_path: str | os.PathLike | None,
                   dynamic_path: str | os.PathLike | None,
                   n_vocab: int | None = None) -> NgramCache:
        static = load(static_path, n_vocab) if static_path else {}
        # like llama-lookup: a dynamic cache that does not exist yet is created at the end
        dynamic = (load(dynamic_path, n_vocab) if dynamic_path and Path(dynamic_path).exists()
                   else {})
        if dynamic_path:
            writable(dynamic_path)  # before generating, not after: nothing is lost
        return cls(static, dynamic, dynamic_path)

    def begin(self, prompt: Sequence[int]) -> None:
        self.context = {}
        self._n_seen = 0

    def _learn(self, tokens: Sequence[int]) -> None:
        for i in range(self._n_seen, len(tokens)):
            update(self.context, tokens[max(0, i - NGRAM_MAX):i + 1], 1)
        self._n_seen = len(tokens)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        self._learn(context)
        tokens = draft(context, k, self.context, self.dynamic, self.static)
        return Tree.chain(tokens, source=self.name)

    # accept: nothing (only committed tokens are counted; a rewind never reaches them)

    def end(self) -> None:
        if self.dynamic_path is None:
            return
        merge(self.dynamic, self.context)
        self.context = {}
        self._n_seen = 0
        save(self.dynamic, self.dynamic_path)


def create(token_chunks: Iterable[Sequence[int]]) -> Cache:
    """A static cache from a corpus, as llama-lookup-create builds one: bigrams only."""
    cache: Cache = {}
    for tokens in token_chunks:
        update(cache, tokens, len(tokens), NGRAM_STATIC, NGRAM_STATIC)
    return cache

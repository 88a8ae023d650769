"""Run native llama.cpp speculative programs (built by scripts/build_native.sh) and parse them.

Used by scripts/bench_run.py and by the acceptance-parity test. Never part of the package.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def native_bin_dir() -> Path | None:
    """SPECLI_NATIVE_BIN, else the cache folder build_native.sh writes for this llama-cpp-python."""
    if os.environ.get("SPECLI_NATIVE_BIN"):
        d = Path(os.environ["SPECLI_NATIVE_BIN"])
    else:
        version = importlib.metadata.version("llama-cpp-python")
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        d = Path(base) / "specli" / "native" / f"llama.cpp-{version}" / "bin"
    return d if (d / "llama-speculative-simple").is_file() else None


@dataclass
class NativeRun:
    n_predict: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    decode_tps: float = 0.0
    steps: list[tuple[int, int]] = field(default_factory=list)  # (accepted, drafted) per step
    drafts: list[list[int]] = field(default_factory=list)  # each draft's tokens (with -v)
    text: str = ""

    @property
    def accept_rate(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0


_STEP = re.compile(r"accepted (\d+)/(\d+) draft tokens")
_DRAFTED = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+)")


def speculative_simple(bin_dir: Path, target: str, draft: str, prompt_file: str, n: int, k: int,
                       threads: int = 2, steps: bool = False, extra: tuple[str, ...] = ()
                       ) -> NativeRun:
    """llama-speculative-simple, greedy; steps=True adds -v to log every step (slower: do not
    time such a run)."""
    return _run(bin_dir / "llama-speculative-simple", target, draft, prompt_file, n, k, threads,
                ("--spec-type", "draft-simple", *extra, *(("-v",) if steps else ())))


def speculative(bin_dir: Path, target: str, draft: str, prompt_file: str, n: int, k: int,
                threads: int = 2, extra: tuple[str, ...] = ()) -> NativeRun:
    """llama-speculative (one draft sequence), greedy."""
    return _run(bin_dir / "llama-speculative", target, draft, prompt_file, n, k, threads, extra)


def ngram(bin_dir: Path, target: str, spec_type: str, prompt_file: str, n: int, k: int,
          threads: int = 2, extra: tuple[str, ...] = ()) -> NativeRun:
    """Draftless speculation, greedy: llama-lookup for ngram-cache (the program that has the
    lookup caches), llama-speculative-simple --spec-type T for the other n-gram types."""
    if spec_type == "ngram-cache":
        return _run(bin_dir / "llama-lookup", target, None, prompt_file, n, k, threads, extra)
    return _run(bin_dir / "llama-speculative-simple", target, None, prompt_file, n, k, threads,
                ("--spec-type", spec_type, *extra))


def head(bin_dir: Path, target: str, spec_type: str, draft: str | None, prompt_file: str,
         n: int, k: int, threads: int = 2, extra: tuple[str, ...] = (),
         steps: bool = True) -> NativeRun:
    """llama-speculative-simple with a draft head (draft-mtp: the target's own layers, no
    draft file; draft-eagle3, -dflash, -dspark: the head's file), greedy; steps adds -v:
    every step's drafted tokens and acceptance (slower: do not time such a run)."""
    return _run(bin_dir / "llama-speculative-simple", target, draft, prompt_file, n, k, threads,
                ("--spec-type", spec_type, *(("-v",) if steps else ()), *extra))


def _run(program: Path, target: str, draft: str | None, prompt_file: str, n: int, k: int,
         threads: int, extra: tuple[str, ...]) -> NativeRun:
    model = ["-m", target, *(["-md", draft, "-td", str(threads)] if draft else [])]
    cmd = [str(program), *model, "-f", prompt_file, "-n", str(n), "--spec-draft-n-max", str(k),
           "--temp", "0", "-t", str(threads), "-c", "4096", "--seed", "1", *extra]
    r = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace",
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{program.name} failed ({r.returncode}): {r.stderr[-2000:]}")
    out = NativeRun(text=r.stdout)

    def grab(name: str) -> str:
        m = re.search(rf"{name}\s*=\s*([0-9.]+)", r.stderr)
        return m.group(1) if m else "0"

    out.n_predict, out.n_drafted = int(grab("n_predict")), int(grab("n_drafted"))
    out.n_accept = int(grab("n_accept"))
    m = re.search(r"decoded\s+\d+ tokens in\s+[0-9.]+ seconds, speed:\s+([0-9.]+) t/s", r.stderr)
    out.decode_tps = float(m.group(1)) if m else 0.0
    out.steps = [(int(a), int(d)) for a, d in _STEP.findall(r.stderr)]
    for pos, token in _DRAFTED.findall(r.stderr):
        if pos == "0" or not out.drafts:
            out.drafts.append([])
        out.drafts[-1].append(int(token))
    return out

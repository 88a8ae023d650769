"""`specli tune-draft`: sweep the draft settings on this machine and this kind of text, against
the target alone measured in the same run."""

from __future__ import annotations

import csv
import io
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from specli.cli import options as o
from specli.cli.console import err, out, spinner
from specli.config import DraftPolicy, PlanError
from specli.errors import SpecliError, UsageError
from specli.headmeta import HEAD_TYPES

if TYPE_CHECKING:
    from specli.plan import SpecPlan

SWEEP = "Sweep"
TASKS = ("mixed", "all", "code-completion", "code-generation", "structured", "summarisation",
         "chat", "creative")


@o.grouped
def tune_draft(
    models: o.ModelFiles = o.MODEL_FILES,
    drafts: Annotated[str, typer.Option(
        "--draft", "--draft-max", "--spec-draft-n-max", help="Draft lengths to sweep, "
        "comma-separated.", rich_help_panel=SWEEP)] = "4,6,8,10,12,16",
    p_mins: Annotated[str, typer.Option(
        "--draft-p-min", "--spec-draft-p-min", help="Draft probability floors to sweep, "
        "comma-separated.", rich_help_panel=SWEEP)] = "0",
    n_seqs: Annotated[str, typer.Option(
        "--draft-n-seq", "--spec-draft-n-seq", help="Draft sequences to sweep, comma-separated "
        "(above 1: a draft tree, with the draft model alone).", rich_help_panel=SWEEP)] = "1",
    p_splits: Annotated[str, typer.Option(
        "--draft-p-split", "--spec-draft-p-split", help="Tree split probabilities to sweep, "
        "comma-separated (for --draft-n-seq above 1).", rich_help_panel=SWEEP)] = "0.1",
    spec_type: Annotated[str | None, typer.Option(
        "--spec-type", help="Speculation types to sweep, comma-separated; join types with + "
        "to combine them (ngram-mod+draft-simple). Default: draft-simple with -md.",
        rich_help_panel=SWEEP, show_default=False)] = None,
    task: Annotated[str, typer.Option(
        "--task", help="Built-in prompts: " + ", ".join(TASKS) + " (mixed: one of each kind).",
        rich_help_panel=SWEEP)] = "mixed",
    file: Annotated[Path | None, typer.Option(
        "-f", "--file", help="Your prompts: one per line, or JSONL with a \"prompt\" field; - "
        "for standard input.",
        rich_help_panel=SWEEP, show_default=False)] = None,
    n_predict: Annotated[int, typer.Option(
        "-n", "--n-predict", help="Tokens generated per prompt.", rich_help_panel=SWEEP)] = 128,
    repeat: Annotated[int, typer.Option(
        "--repeat", help="Runs per setting; the median is reported.",
        rich_help_panel=SWEEP)] = 2,
    chat: Annotated[bool, typer.Option(
        "--chat/--no-chat", help="Wrap prompts in the target's chat template.",
        rich_help_panel=SWEEP)] = True,
    resources: o.Resources = o.RESOURCE_FLAGS,
    gpu: o.GpuFlags = o.GPU_FLAGS,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the sweep as one JSON object on stdout: every point, the best, "
        "the cost model and whether the measurement is reliable.",
        rich_help_panel=o.OUTPUT)] = False,
    csv_out: Annotated[bool, typer.Option(
        "--csv", help="Print the points as CSV on stdout.", rich_help_panel=o.OUTPUT)] = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Draw speedup against the draft length into a PNG (needs matplotlib: "
        "pip install 'specli[plot]').", rich_help_panel=o.OUTPUT, show_default=False)] = None,
    verbose: o.Verbose = False,
) -> None:
    """Find the fastest draft setting for this machine and this kind of text.

    Every setting of the grid (--draft × --draft-p-min × --spec-type × --draft-n-seq ×
    --draft-p-split) and the target alone
    generate greedily on the same prompts, interleaved, --repeat times; each gets its median
    tokens/s, range, acceptance and speedup, next to the speedup a cost model measured here
    predicts. The best setting is printed with the command that uses it.
    """
    from specli import tuning

    ks = _ints(drafts, "--draft")
    ps = _floats(p_mins, "--draft-p-min")
    seqs = _ints(n_seqs, "--draft-n-seq")
    splits = _floats(p_splits, "--draft-p-split")
    if n_predict < 1 or repeat < 1:
        raise UsageError("-n/--n-predict and --repeat must be at least 1")
    if task not in TASKS:
        raise UsageError(f"unknown --task {task!r}", hint="one of " + ", ".join(TASKS))
    if json_out and csv_out:
        raise UsageError("give --json or --csv, not both")
    quiet = json_out or csv_out
    if plot is not None:  # before the sweep, not after it
        _check_plot(plot)
    model, model_draft = models.resolve(
        quiet=quiet, spec_types=[t for item in (spec_type or "").split(",")
                                 for t in item.split("+")])
    plan, types = _types(spec_type, model_draft, max(ks), max(seqs))
    settings = tuning.grid(ks, ps, types, seqs, splits)
    texts = _prompts(file, task)
    loaded = [t for t in plan.types if t != "draft-simple"]

    from specli.plan import check_files, open_engine

    target, draft_model = resources.model_params(model, model_draft, verbose=verbose, gpu=gpu)
    check_files(target, draft_model, plan)
    with spinner("loading models", quiet):
        engine = open_engine(target, draft_model, plan)
    try:
        prompts = [engine.tokenize(t, chat=chat) for t in texts]
        with _progress(len(settings) + 1, repeat, quiet) as advance:
            result = tuning.sweep(engine, prompts, settings, n_predict, repeat,
                                  progress=advance)
        if model_draft is not None and not any(t in HEAD_TYPES for t in loaded):
            tuning.predict(result, tuning.measure_costs(engine, prompts[0], max(ks)))
    finally:
        engine.close()
    if json_out:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    elif csv_out:
        sys.stdout.write(_csv(result))
    else:
        _print(result, model, model_draft, o.speed_args(resources, gpu))
    if plot is not None:
        _plot(result, plot)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes whole numbers, comma-separated: {text!r}") from None
    if not values or any(v < 1 or v > 64 for v in values):
        raise UsageError(f"{flag} values must be between 1 and 64: {text!r}")
    return sorted(set(values))


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes numbers, comma-separated: {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UsageError(f"{flag} values must be between 0 and 1: {text!r}")
    return sorted(set(values))


def _types(text: str | None, model_draft: str | None, k: int,
           n_seq: int) -> tuple[SpecPlan, list[tuple[str, ...]]]:
    """The sweep's plan (resolved once: every type it sweeps loaded, the longest draft and
    the most draft sequences) and its type lists, each checked against it."""
    from specli.plan import SpecPlan, draft_head

    head = draft_head(model_draft)
    if text is None:
        if model_draft is None:
            raise UsageError("nothing to sweep: give a draft model (-md) or --spec-type")
        items = [("-md", [head.spec_type if head else "draft-simple"])]
    else:
        items = [(item, o.spec_types(item.replace("+", ","))) for item in text.split(",")]
    loaded = sorted({t for _, types in items for t in types if t != "draft-simple"})
    if n_seq > 1 and any(types != ["draft-simple"] for _, types in items):
        raise UsageError("--draft-n-seq above 1 sweeps draft trees, which draft with the "
                         "model alone", hint="drop --spec-type, or give -md and "
                         "--spec-type draft-simple")
    try:  # what the loaded models serve: the draft model or head, and the n-gram types
        plan = SpecPlan.resolve(loaded, model_draft is not None,
                                DraftPolicy(n_max=k, n_seq=n_seq), head=head)
    except PlanError as e:
        raise UsageError(f"--spec-type {text}: {e.said(o.FLAGS)}",
                         hint=o.PLAN_HINTS.get(e.field)) from None
    combos = []
    for item, types in items:  # settings by commas, the types of one setting by +
        try:
            combos.append(plan.serves(types))
        except PlanError as e:
            raise UsageError(f"--spec-type {item}: {e.said(o.FLAGS)}",
                             hint=o.PLAN_HINTS.get(e.field)) from None
    return plan, combos


def _prompts(file: Path | None, task: str) -> list[str]:
    from specli.tuning import PROMPT_SETS

    if file is None:
        if task == "mixed":
            return [prompts[0] for prompts in PROMPT_SETS.values()]
        if task == "all":
            return [p for prompts in PROMPT_SETS.values() for p in prompts]
        return list(PROMPT_SETS[task])
    from specli.cli.run import read_text

    try:
        text = read_text(file)
    except (OSError, UnicodeDecodeError) as e:
        raise SpecliError(f"cannot read prompt file {file}: {e}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{file}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str):
                raise UsageError(f'{file}:{n}: a JSONL line needs a "prompt" string')
            line = doc["prompt"]
        prompts.append(line)
    if not prompts:
        raise UsageError(f"prompt file is empty: {file}")
    return prompts


class _progress:
    """A Rich progress bar on stderr on a terminal; elsewhere (CI logs, a file) one line per
    finished run of a setting; nothing with --json or --csv. The callback advances it."""

    def __init__(self, settings: int, repeat: int, quiet: bool):
        self.total, self.bar, self.quiet = settings * repeat, None, quiet
        if not quiet and err.is_terminal:
            from rich.progress import Progress

            self.bar = Progress(console=err, transient=True)

    def __enter__(self):
        if self.bar is None:
            if self.quiet:
                return None
            return lambda label, figures, done, total: err.print(
                f"tune-draft: [{done}/{total}] {label}: {figures}", markup=False,
                soft_wrap=True)
        self.bar.start()
        task = self.bar.add_task("sweeping", total=self.total)
        return lambda label, figures, done, total: self.bar.update(
            task, advance=1, description=f"{label} ({done}/{total})")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _print(result, model: str, model_draft: str | None, placement: Sequence[str] = ()) -> None:
    base = result.baseline
    table = Table(show_edge=False, pad_edge=False)
    for name in ("setting", "t/s", "range", "accept", "len", "speedup", "predicted"):
        table.add_column(name, justify="left" if name == "setting" else "right", no_wrap=True)
    rows = [base, *result.points]
    for p in rows:
        table.add_row(
            _label(p), f"{p.median:.1f}",
            f"{min(p.tps):.1f}-{max(p.tps):.1f}" if len(p.tps) > 1 else "-",
            "-" if p.setting is None else f"{p.accept_rate:.1%}",
            "-" if p.setting is None else f"{p.mean_accept_len:.2f}",
            "1.00x" if p.setting is None else f"{p.speedup:.2f}x",
            "" if p.predicted is None else f"{p.predicted:.2f}x")
    out.print(table)
    top = max(p.median for p in rows) or 1.0
    width = max(len(_label(p)) for p in rows)
    for p in rows:  # tokens/s per setting, as bars
        out.print(f"{_label(p):<{width}} {'█' * max(1, round(40 * p.median / top))} "
                  f"{p.median:.1f} t/s", markup=False)
    if result.predicted_best is not None and result.costs is not None:
        out.print(f"cost model: draft {1e3 * result.costs.c:.2f} ms/token, target "
                  f"{1e3 * result.costs.v[0]:.2f} ms for 1 token, "
                  f"{1e3 * result.costs.v[-1]:.2f} ms for {len(result.costs.v)}; "
                  f"predicted best --draft {result.predicted_best}", markup=False)
    repeat = len(base.tps)
    if repeat == 1:
        out.print("one run per setting (--repeat 1): no range, and no check of the machine's "
                  "noise; --repeat 3 gives both", markup=False)
    unreliable = result.unreliable
    if unreliable:
        out.print(f"unreliable: {unreliable}; rerun with --repeat {max(repeat + 1, 3)} on an "
                  "idle machine", markup=False)
    best = result.best
    if unreliable:
        out.print(f"best measured (unreliable): {best.setting.label}, {best.speedup:.2f}x the "
                  f"target alone", markup=False)
        return
    if best.speedup <= 1.0:
        out.print(f"no setting beats the target alone (best: {best.setting.label}, "
                  f"{best.speedup:.2f}x): run without speculation (--no-spec)", markup=False)
        return
    s = best.setting
    out.print(f"best: {s.label}: {best.median:.1f} t/s, {best.speedup:.2f}x the target alone "
              f"({base.median:.1f} t/s)", markup=False)
    args = ["-m", model]
    if "draft-simple" in s.types or any(t in HEAD_TYPES and t != "draft-mtp" for t in s.types):
        args += ["-md", model_draft]
    if [t for t in s.types if t != "draft-simple"]:
        args += ["--spec-type", ",".join(s.types)]
    args += ["--draft", str(s.k), *placement]
    if s.p_min:
        args += ["--draft-p-min", f"{s.p_min:g}"]
    if s.n_seq > 1:
        args += ["--draft-n-seq", str(s.n_seq), "--draft-p-split", f"{s.p_split:g}"]
    out.print("  specli run " + shlex.join(args), markup=False)
    out.print("  specli serve " + shlex.join(args), markup=False)


def _label(p) -> str:
    return p.setting.label if p.setting else "target alone"


def _csv(result) -> str:
    buf = io.StringIO()
    fields = ["label", "baseline", "draft", "draft_p_min", "draft_n_seq", "draft_p_split",
              "spec_types", "tps_median", "tps_min",
              "tps_max", "accept_rate", "mean_accept_len", "speedup", "predicted_speedup"]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for p in [result.baseline, *result.points]:
        row = p.to_dict()
        row["spec_types"] = "+".join(row["spec_types"])
        w.writerow(row)
    return buf.getvalue()


def _check_plot(path: Path) -> None:
    """--plot's needs, checked before any work: matplotlib, and a folder to write into."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib", hint="pip install 'specli[plot]'")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"--plot {path}: the folder {folder} does not exist")


def _plot(result, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecliError("--plot needs matplotlib", hint="pip install 'specli[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series: dict[tuple, list] = {}
    for p in result.points:
        st = p.setting
        series.setdefault((st.types, st.p_min, st.n_seq, st.p_split), []).append(p)
    for (types, p_min, n_seq, p_split), pts in series.items():
        pts.sort(key=lambda p: p.setting.k)
        label = "+".join(types) + (f" p-min {p_min:g}" if p_min else "") + (
            f" n-seq {n_seq} p-split {p_split:g}" if n_seq > 1 else "")
        ax.plot([p.setting.k for p in pts], [p.speedup for p in pts], marker="o", label=label)
        pred = [(p.setting.k, p.predicted) for p in pts if p.predicted is not None]
        if pred:
            ax.plot(*zip(*pred, strict=True), linestyle="--", marker="x",
                    label=label + " (predicted)")
    ax.set_xticks(sorted({p.setting.k for p in result.points}))
    ax.axhline(1.0, color="gray", linewidth=1, label="target alone")
    ax.set_xlabel("draft length k (--draft)")
    ax.set_ylabel("speedup vs the target alone")
    ax.set_title(f"tune-draft: baseline {result.baseline.median:.1f} t/s")
    ax.legend()
    ax.grid(alpha=0.3)
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise SpecliError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)

"""One generation, from parsed settings to text and statistics: what `specli run` prints and
`specli audit` watches. No flags, no printing: callers pass callbacks for text and notes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specli.config import ModelParams, SamplingParams
from specli.stats import Stats

if TYPE_CHECKING:
    from specli.plan import SpecPlan


@dataclass(frozen=True)
class Request:
    """Everything one generation needs, as the CLI parsed it (paths already resolved, the
    plan resolved once: what drafts and how much, its files checked: plan.check_files)."""

    target: ModelParams
    draft: ModelParams | None
    text: str
    n_predict: int
    sampling: SamplingParams
    plan: SpecPlan
    chat: bool = False
    speculative: bool = True  # False: --no-spec, the target alone
    baseline: bool = False  # also decode with the target alone, same seed
    ignore_eos: bool = False  # no end-of-generation token is ever sampled (--ignore-eos)
    reverse_prompts: tuple[str, ...] = ()  # -r: the generation stops once one is printed
    # a person's -p without --chat: say, if the target has a template, that --chat answers
    suggest_chat: bool = False


@dataclass
class Generation:
    text: str
    stats: Stats
    baseline_identical: bool | None = None  # greedy runs with a baseline only

    @property
    def interrupted(self) -> bool:
        return self.stats.finish_reason == "interrupted"


class Interrupt:
    """Ctrl-C as a request to stop (the caller's SIGINT handler calls it): while tokens are
    generated the generation ends at the next token, caches rewound and statistics whole
    (finish reason "interrupted"); before that (loading), or a second time, it interrupts at
    once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.armed = self.hit = False

    def __call__(self, *_signal) -> None:
        if not self.armed or self.hit:
            raise KeyboardInterrupt
        self.hit = True


def changed(req: Request, engine) -> list[str]:
    """What llama.cpp made of the settings that differs from what was asked, said rather
    than passed over: the context it padded, a --draft longer than the context can verify
    (-ngl with no GPU is warned where every command's flags are read: options.Resources)."""
    out = []
    n_ctx = engine.target.n_ctx
    if n_ctx != req.target.n_ctx:
        out.append(f"note: -c {req.target.n_ctx} became {n_ctx} (llama.cpp pads the context "
                   "to a multiple of 256)")
    k = req.plan.policy.n_draft
    if engine.draft is not None and k >= n_ctx:
        out.append(f"note: --draft {k} is more than the {n_ctx}-token context can verify; "
                   "each draft stops at the context's end")
    return out


def generate(req: Request, *, on_text: Callable[[str], None] | None = None,
             on_note: Callable[[str], None] | None = None,
             phase: Callable[[str], AbstractContextManager] | None = None,
             interrupt: Interrupt | None = None) -> Generation:
    """Load the pair, generate, optionally measure the target alone, close the models.

    on_text receives the text as it is decoded; on_note one-line remarks for a person (no
    draft, no chat template); phase(name) wraps the slow parts (a spinner, on a terminal);
    interrupt, once hit, ends the generation at the next token (no baseline then)."""
    from specli.plan import open_engine

    phase = phase or (lambda _name: nullcontext())
    if req.chat:  # the templates' process starts while the models load (template_host)
        from specli import template_host

        template_host.pool().prestart()
    with phase("loading models"):
        engine = open_engine(req.target, req.draft, req.plan)
    try:
        if on_note and engine.draft is None and req.speculative:
            on_note("note: no draft model (-md) or n-gram type (--spec-type): decoding with "
                    "the target alone")
        if on_note and req.chat and engine.target.chat_template() is None:
            on_note("note: the target has no chat template; using ChatML")
        if on_note and req.suggest_chat and engine.target.chat_template() is not None:
            on_note("note: the prompt is continued as text, as llama-speculative does; --chat "
                    "wraps it in the model's chat template for an answer")
        if on_note:
            for line in changed(req, engine):
                on_note(line)
        ids, draft_ids = engine.prompt(req.text, chat=req.chat)
        sampling = req.sampling.banning(engine.target.eog) if req.ignore_eos else req.sampling
        pieces: list[str] = []
        stats = Stats()
        stream = engine.stream(ids, req.n_predict, sampling, stats=stats,
                               draft_prompt=draft_ids)
        if interrupt is not None:
            interrupt.armed = True
        stopped = reversed_at = False
        tail = ""  # the text's end, as long as the longest reverse prompt needs
        keep = max((len(r) for r in req.reverse_prompts), default=0)
        try:
            for chunk in stream:
                pieces.append(chunk.text)
                if on_text and chunk.text:
                    on_text(chunk.text)
                if keep and chunk.text:  # llama.cpp prints the reverse prompt, then stops
                    tail = (tail + chunk.text)[-(keep + len(chunk.text)):]
                    if any(r in tail for r in req.reverse_prompts if r):
                        reversed_at = chunk.finish_reason is None
                        break
                if interrupt is not None and interrupt.hit and chunk.finish_reason is None:
                    stopped = True
                    break
        finally:
            if interrupt is not None:
                interrupt.armed = False
            stream.close()  # caches rewound, the statistics complete
        if stopped:
            stats.finish_reason = "interrupted"
        elif reversed_at:
            stats.finish_reason = "stop"
        out = Generation("".join(pieces), stats)
        if req.baseline and not out.interrupted:
            with phase("measuring the baseline (target alone)"):
                plain = engine.complete(ids, req.n_predict, replace(sampling,
                                                                    seed=stats.seed),
                                        speculative=False)
            stats.baseline_decode_tps = plain.stats.decode_tps
            out.baseline_identical = plain.text == out.text if req.sampling.greedy else None
        return out
    finally:
        engine.close()

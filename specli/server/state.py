"""What the server decided before it started (ServerConfig), and what it holds while it
runs (State: the slots, once loaded, and the metrics)."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from specli import rpc, template_host
from specli.backend import knows_template
from specli.config import ModelParams, SamplingParams
from specli.engine import Engine
from specli.errors import UsageError
from specli.grammar_host import Checkers, GrammarHost
from specli.plan import SpecPlan, check_files, open_slots
from specli.prompt import jinja_source, template_caps
from specli.server.metrics import Metrics
from specli.server.slots import Slot, SlotPool
from specli.server.streams import Streams
from specli.stats import Stats

MAX_BODY = 8 << 20  # bytes: far more than any context holds as text


@dataclass(frozen=True)
class ServerConfig:
    """Everything `specli serve` decides before the app starts."""

    target: ModelParams
    draft: ModelParams | None = None
    # what drafts and how much, resolved once (cli/serve.py); checked: its files too
    plan: SpecPlan = field(default_factory=SpecPlan)
    checked: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1
    parallel: int = 1
    api_keys: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # -a: the model's names, the first in answers
    tags: tuple[str, ...] = ()  # --tags: informational (/v1/models)
    verbose: bool = False  # -v: every OpenAI-style answer carries llama-server's __verbose
    slot_similarity: float = 0.1  # -sps: llama-server's slot choice by shared prompt
    metrics: bool = False
    slots: bool = True  # GET /slots
    cors_origins: str = "*"  # llama-server's CORS defaults
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    timeout: float = 600.0
    max_queue: int = 16
    max_body: int = MAX_BODY
    log_requests: bool = True  # a line on stderr per generation (--log-disable: none)
    reasoning: str = "auto"  # --reasoning: off renders templates with enable_thinking false
    reasoning_format: str = "deepseek"  # --reasoning-format: where reasoning goes
    template_kwargs: dict = field(default_factory=dict)  # --chat-template-kwargs

    @property
    def model_id(self) -> str:
        return self.aliases[0] if self.aliases else os.path.basename(self.target.path)


class State:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.pool: SlotPool | None = None
        self.error: str | None = None
        self.down: str | None = None  # an RPC server was lost: every answer is 503
        self.listening: list[int] = []  # the listening sockets' descriptors (kept on restart)
        self._lost = threading.Lock()
        if config.target.rpc:
            rpc.on_lost(self.worker_lost)
        self.metrics = Metrics()
        self.streams = Streams()  # resumable streams by X-Conversation-Id (streams.py)
        self.created = int(time.time())
        # a client's grammars and JSON schemas run in processes of their own: one checks
        # each before it takes a slot, one per slot holds those being generated with
        self.grammars = Checkers(config.target.path, n=min(4, max(2, config.parallel)))
        self.slot_grammars: list[GrammarHost] = []
        # a request's settings are resolved (a grammar checked, a logit bias tokenized) on
        # threads of their own, and a conversation's prompt (planned, rendered, tokenized)
        # on others: requests queued for a grammar checker or a template process never take
        # the threads that tokenize other prompts (asyncio's default executor)
        self._jobs = ThreadPoolExecutor(max_workers=32, thread_name_prefix="specli-job")
        self._prompts = ThreadPoolExecutor(max_workers=16, thread_name_prefix="specli-prompt")

    def done(self, stats: Stats) -> None:
        """A generation ended (a task on the slots' loop): counted for /metrics, and one line on
        stderr with its timings, as llama-server logs each request's."""
        self.metrics.observe(stats)
        if not self.config.log_requests:
            return
        from specli.server.formats import timings

        t = timings(stats)
        line = (f"specli serve: prompt {t['prompt_n']} tokens ({t['cache_n']} cached) in "
                f"{t['prompt_ms']:.0f} ms, {t['prompt_per_second']:.1f} t/s; generated "
                f"{t['predicted_n']} tokens in {t['predicted_ms']:.0f} ms, "
                f"{t['predicted_per_second']:.1f} t/s; drafted {t['draft_n']}, accepted "
                f"{t['draft_n_accepted']}; steps {stats.n_steps} drafted, {stats.n_plain} plain; "
                f"finish {stats.finish_reason or '-'}\n")
        try:
            sys.stderr.write(line)
        except (OSError, ValueError):  # stderr gone: the answer still goes out
            pass

    @property
    def plan(self) -> SpecPlan:
        """What the server drafts with (resolved and checked before it listened)."""
        return self.config.plan

    @property
    def engine(self) -> Engine:
        """Slot 0's engine, for tokenizing and templates (read-only, thread-safe calls)."""
        return self.pool.slots[0].engine

    def load(self) -> None:
        c = self.config
        n_ctx = max(c.target.n_ctx // c.parallel, 16)  # llama-server divides -c among slots
        target = replace(c.target, n_ctx=n_ctx)
        draft = replace(c.draft, n_ctx=max(c.draft.n_ctx // c.parallel, 16)) if c.draft else None
        # (each slot's n_ctx is not among what check_files checked)
        if not c.checked:
            check_files(target, draft, c.plan)
        engines, shared = open_slots(c.parallel, target, draft, c.plan)
        for e in engines:
            self.slot_grammars.append(GrammarHost(c.target.path))
            e.target.grammar_source = self.slot_grammars[-1].open
        self.pool = SlotPool([Slot(i, e) for i, e in enumerate(engines)], c.max_queue,
                             c.timeout, on_done=self.done, contexts=shared,
                             similarity=c.slot_similarity, on_close=self.close_grammars)
        _ = self.engine.target.max_token_bytes  # the prompt bound, measured once, here
        if c.sampling.grammar:  # the operator's default grammar: refused before listening
            self.engine.target.grammar(c.sampling.grammar)
        if c.target.rpc:
            threading.Thread(target=self.watch_workers, daemon=True,
                             name="specli-rpc-watch").start()
        template = self.engine.target.chat_template()
        if not c.target.jinja and template and not knows_template(template):
            sys.stderr.write("specli serve: warning: llama.cpp does not recognise the model's "
                             "chat template; without --jinja, chat requests use ChatML\n")
        # chat templates render in processes of their own, within a deadline and a memory
        # limit (template_host): as many as grammar checkers, probed here once
        template_host.configure(len(self.grammars.hosts)).prestart()
        jinja, source = jinja_source(self.engine.target)
        if jinja:
            try:
                template_caps(source)
            except UsageError:
                pass  # (Busy: a request probes it again)

    @property
    def renderers(self) -> template_host.Renderers | template_host.Here:
        """The process's template renderers (sized at load)."""
        return template_host.pool()

    async def jobs(self, fn, *args, **kw):
        """fn(*args, **kw) on the request threads (see __init__), awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._jobs, functools.partial(fn, *args, **kw))

    async def prompts(self, fn, *args):
        """fn(*args) on the prompt threads (see __init__), awaited."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompts, functools.partial(fn, *args))

    def stopping(self) -> None:
        """The server was told to stop (SIGTERM, Ctrl-C): generations end at their next token,
        and one inside a grammar's test at once (its process is killed)."""
        if self.pool is not None:
            for g in list(self.pool.active):
                g.cancel()
        for host in (self.grammars, *self.slot_grammars, self.renderers):
            host.kill()

    def close_grammars(self) -> None:
        for host in (self.grammars, *self.slot_grammars, self.renderers):
            host.close()
        self._jobs.shutdown(wait=False, cancel_futures=True)
        self._prompts.shutdown(wait=False, cancel_futures=True)

    def worker_lost(self, error: rpc.WorkerLost, gone: tuple[str, ...]) -> None:
        """An RPC server went away mid-decode (on llama.cpp's thread, which never returns):
        the requests in flight get 503, so do new ones and /health, and once every lost
        server accepts connections again the server starts over in place (same pid, same
        command line): the model's layers there are gone and must be loaded again."""
        with self._lost:
            if self.down:  # noticed already (the watch, or another decode thread)
                return
            if error.unreachable:
                self.down = (f"{error.message}; this server restarts when "
                             f"{'it answers' if len(gone) == 1 else 'they answer'} again")
            else:  # it answers, and failed: restarting would fail the same way, forever
                self.down = (f"{error.message} ({error.hint}); this server needs a restart")
        sys.stderr.write(f"specli serve: error: {self.down}\n")
        sys.stderr.flush()
        if self.pool is not None:
            self.pool.fail(self.down)
        if not error.unreachable:
            return
        threading.Thread(target=self._restart_when_back, args=(gone, self.listening),
                         daemon=True, name="specli-rpc-watch").start()

    def watch_workers(self) -> None:
        """Between decodes nothing talks to the RPC servers: notice one that went away from
        its connection's state, so /health says so before a request finds out."""
        eps = self.config.target.rpc
        while not self.down:
            gone = rpc.closed(eps)
            if gone:
                ep, why = next(iter(gone.items()))
                self.worker_lost(rpc.WorkerLost(f"the RPC server {ep} is gone ({why})"),
                                 tuple(gone))
                return
            time.sleep(0.5)

    @staticmethod
    def _restart_when_back(gone: tuple[str, ...], listening: list[int]) -> None:
        while any(rpc.probe(ep, timeout=1.0) is not None for ep in gone):
            time.sleep(1.0)
        sys.stderr.write(f"specli serve: {', '.join(gone)} answers again: restarting\n")
        rpc.exec_self(keep=listening)

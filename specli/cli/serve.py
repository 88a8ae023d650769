"""`specli serve`: an OpenAI-compatible HTTP server with speculative decoding (llama-server -md)."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specli import config
from specli.cli import options as o
from specli.cli.console import err
from specli.config import SamplingParams
from specli.errors import SpecliError, UsageError

if TYPE_CHECKING:
    import uvicorn

SERVER = "Server"


@o.grouped
def serve(
    models: o.ModelFiles = o.MODEL_FILES,
    host: Annotated[str, typer.Option(
        "--host", help="Addresses to listen on, comma-separated, or UNIX socket paths ending "
        "in .sock (llama-server's). 0.0.0.0 exposes the server to the network.",
        envvar="LLAMA_ARG_HOST", rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", help="Port to listen on (0: any free port).", envvar="LLAMA_ARG_PORT",
        rich_help_panel=SERVER)] = 8080,
    parallel: Annotated[int, typer.Option(
        "-np", "--parallel", help="Requests decoded at once (slots); -c is divided among them, "
        "as llama-server does.", envvar="LLAMA_ARG_N_PARALLEL", rich_help_panel=SERVER)] = 1,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Require this key (Authorization: Bearer KEY or X-Api-Key); "
        "repeat or comma-separate for several.", envvar="LLAMA_API_KEY", rich_help_panel=SERVER,
        show_default=False)] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="Read keys from a file, one per line.",
        envvar="LLAMA_ARG_API_KEY_FILE", rich_help_panel=SERVER,
        show_default=False)] = None,
    metrics: Annotated[bool, typer.Option(
        "--metrics", help="Serve Prometheus metrics at /metrics.",
        envvar="LLAMA_ARG_ENDPOINT_METRICS", rich_help_panel=SERVER)] = False,
    slots: Annotated[bool, typer.Option(
        "--slots/--no-slots", help="Serve the slots' state at GET /slots.",
        envvar="LLAMA_ARG_ENDPOINT_SLOTS", rich_help_panel=SERVER)] = True,
    cors_origins: Annotated[str, typer.Option(
        "--cors-origins", help="Allowed CORS origins, comma-separated; * echoes any Origin, "
        "localhost only a localhost one.", envvar="LLAMA_ARG_CORS_ORIGINS",
        rich_help_panel=SERVER)] = "*",
    cors_methods: Annotated[str, typer.Option(
        "--cors-methods", help="Allowed CORS methods.", envvar="LLAMA_ARG_CORS_METHODS",
        rich_help_panel=SERVER)] = "GET, POST, DELETE, OPTIONS",
    cors_headers: Annotated[str, typer.Option(
        "--cors-headers", help="Allowed CORS headers.", envvar="LLAMA_ARG_CORS_HEADERS",
        rich_help_panel=SERVER)] = "*",
    cors_credentials: Annotated[bool, typer.Option(
        "--cors-credentials/--no-cors-credentials", help="Allow credentials in CORS.",
        envvar="LLAMA_ARG_CORS_CREDENTIALS", rich_help_panel=SERVER)] = True,
    jinja: Annotated[bool, typer.Option(
        "--jinja/--no-jinja", help="Render chat templates as Jinja (sandboxed), or with "
        "--no-jinja through llama.cpp's built-in renderers, as llama-server does.",
        envvar="LLAMA_ARG_JINJA", rich_help_panel=SERVER)] = True,
    chat_template: Annotated[str | None, typer.Option(
        "--chat-template", metavar="JINJA_TEMPLATE|NAME", help="Chat template replacing the "
        "file's: Jinja source, or a llama.cpp built-in name (chatml, llama3, command-r, "
        "gemma...; `specli serve --list-chat-templates` lists them).",
        envvar="LLAMA_ARG_CHAT_TEMPLATE", rich_help_panel=SERVER, show_default=False)] = None,
    chat_template_file: Annotated[Path | None, typer.Option(
        "--chat-template-file", metavar="FILE", help="Read the chat template from a file.",
        envvar="LLAMA_ARG_CHAT_TEMPLATE_FILE", rich_help_panel=SERVER,
        show_default=False)] = None,
    list_templates: Annotated[bool, typer.Option(
        "--list-chat-templates", help="Print llama.cpp's built-in chat template names and "
        "exit.", rich_help_panel=SERVER)] = False,
    slot_similarity: Annotated[float, typer.Option(
        "-sps", "--slot-prompt-similarity", help="A request goes to the idle slot whose cache "
        "holds more than this fraction of its prompt (the most), else to the least recently "
        "used; 0 turns the match off.", rich_help_panel=SERVER)] = 0.1,
    timeout: Annotated[float, typer.Option(
        "-to", "--timeout", help="Seconds a request may wait for a free slot before a 503.",
        envvar="LLAMA_ARG_TIMEOUT", rich_help_panel=SERVER)] = 600.0,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", help="Requests that may wait for a slot; one more gets a 503 with "
        "Retry-After.", rich_help_panel=SERVER)] = 16,
    alias: Annotated[str | None, typer.Option(
        "-a", "--alias", help="Model names, comma-separated: as in llama-server, the first "
        "in alphabetical order names the model in /v1/models and responses (a request may "
        "name any model). Default: the file name.",
        envvar="LLAMA_ARG_ALIAS", rich_help_panel=SERVER, show_default=False)] = None,
    tags: Annotated[str | None, typer.Option(
        "--tags", help="Model tags, comma-separated: the `tags` of /v1/models "
        "(informational, as in llama-server).", envvar="LLAMA_ARG_TAGS",
        rich_help_panel=SERVER, show_default=False)] = None,
    grammar: Annotated[str | None, typer.Option(
        "--grammar", metavar="GBNF", help="A GBNF grammar for requests that bring no grammar "
        "or JSON schema of their own (llama-server's default).", rich_help_panel=SERVER,
        show_default=False)] = None,
    grammar_file: Annotated[Path | None, typer.Option(
        "--grammar-file", metavar="FILE", help="Read that grammar from a file.",
        rich_help_panel=SERVER, show_default=False)] = None,
    json_schema: Annotated[str | None, typer.Option(
        "-j", "--json-schema", metavar="SCHEMA", help="A JSON schema for requests that bring "
        "no grammar or schema of their own.", rich_help_panel=SERVER,
        show_default=False)] = None,
    json_schema_file: Annotated[Path | None, typer.Option(
        "-jf", "--json-schema-file", metavar="FILE", help="Read that schema from a file.",
        rich_help_panel=SERVER, show_default=False)] = None,
    reasoning: Annotated[str, typer.Option(
        "-rea", "--reasoning", metavar="on|off|auto", help="Reasoning in the chat: off renders "
        "templates with enable_thinking false (Qwen3, QwQ, DeepSeek R1, Command R7B...); on "
        "and auto leave it on.", envvar="LLAMA_ARG_REASONING", rich_help_panel=SERVER)
    ] = "auto",
    reasoning_format: Annotated[str, typer.Option(
        "--reasoning-format", metavar="FORMAT", help="Where an answer's reasoning (<think>... "
        "</think> and its kin) goes: none leaves it in the content; auto, deepseek and "
        "deepseek-legacy put it in reasoning_content.", envvar="LLAMA_ARG_THINK",
        rich_help_panel=SERVER)] = "auto",
    reasoning_preserve: Annotated[bool, typer.Option(
        "--reasoning-preserve/--no-reasoning-preserve", help="Keep earlier turns' reasoning "
        "in the history the template renders, for the templates that can drop it (GLM 4.7, "
        "DeepSeek V4, LFM2.5, Nemotron...: their preserve_thinking, clear_thinking, "
        "drop_thinking); a request's chat_template_kwargs.preserve_reasoning goes over it.",
        envvar="LLAMA_ARG_REASONING_PRESERVE", rich_help_panel=SERVER)] = True,
    template_kwargs: Annotated[str | None, typer.Option(
        "--chat-template-kwargs", metavar="JSON", help="Variables for the chat template, a "
        "JSON object (e.g. '{\"enable_thinking\": false}'); a request's chat_template_kwargs "
        "go over them.", envvar="LLAMA_ARG_CHAT_TEMPLATE_KWARGS", rich_help_panel=SERVER,
        show_default=False)] = None,
    log_disable: Annotated[bool, typer.Option(
        "--log-disable", help="No line on stderr per request (its prompt and generation "
        "timings, draft counts and finish), as llama-server's own flag silences its log.",
        rich_help_panel=SERVER)] = False,
    n_predict: Annotated[int, typer.Option(
        "-n", "--n-predict", "--predict", help="Default tokens per request when it sets no "
        "max_tokens; -1 until end of generation or a full context.",
        envvar="LLAMA_ARG_N_PREDICT", rich_help_panel=SERVER)] = -1,
    drafting: o.Drafting = o.DRAFTING_FLAGS,
    sampling: SamplingParams = o.SAMPLING_FLAGS,
    resources: o.Resources = o.RESOURCE_FLAGS,
    gpu: o.GpuFlags = o.GPU_FLAGS,
    verbose: o.Verbose = False,
) -> None:
    """Serve the target over HTTP (OpenAI and llama-server routes) with speculative decoding.

    /v1/chat/completions (with tools: tool_calls read back per model family, reasoning in
    reasoning_content), /v1/completions, /v1/models, /completion, /props, /health, Anthropic's
    /v1/messages, OpenAI's /v1/responses and (with --metrics) /metrics. A request may carry
    its own `speculative` object ({"n_max", "n_min", "p_min", "n_seq", "p_split", "type"}, or
    false). With no -m, the embedded SmolLM2 pair is served.
    """
    if list_templates:
        from specli.backend import builtin_templates

        print("\n".join(builtin_templates()))
        return
    if parallel < 1 or max_queue < 0 or timeout <= 0:
        raise UsageError("-np/--parallel must be at least 1, --max-queue at least 0 and "
                         "--timeout more than 0")
    if n_predict < -1 or n_predict == 0:
        raise UsageError(f"-n/--n-predict must be -1 or at least 1, got {n_predict}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    if not 0.0 <= slot_similarity <= 1.0:
        raise UsageError(f"-sps/--slot-prompt-similarity must be between 0 and 1, got "
                         f"{slot_similarity}")
    hosts = _hosts(host, port)
    keys = _keys(api_key or [], api_key_file)
    aliases = names(alias)
    template = _template(chat_template, chat_template_file, jinja)
    drafting = batch_policy(drafting)
    if drafting.ngram.lookup_dynamic and parallel > 1:
        raise UsageError("-lcd/--lookup-cache-dynamic with --parallel > 1: each slot would "
                         "overwrite the others' cache", hint="use -lcs, or -np 1")
    model, model_draft = models.resolve(spec_types=drafting.types)
    plan = o.plan(drafting, model_draft)

    from specli.plan import check_files

    target, draft_model = resources.model_params(model, model_draft, verbose=verbose, gpu=gpu)
    target = replace(target, chat_template=template, jinja=jinja)
    # a bad pair or file is refused before listening (and before the web stack's 0.8 s of
    # imports)
    check_files(target, draft_model, plan)
    from specli.cli.run import constrained

    sampling = constrained(sampling, grammar, grammar_file, json_schema, json_schema_file)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpecliError("specli serve needs the server extra",
                          hint="pip install 'specli[server]'") from None
    from specli.server import ServerConfig

    config = ServerConfig(
        target=target, draft=draft_model, plan=plan, checked=True, sampling=sampling,
        n_predict=n_predict, parallel=parallel, api_keys=tuple(keys), aliases=aliases,
        tags=names(tags), verbose=verbose,
        slot_similarity=slot_similarity,
        metrics=metrics, slots=slots, timeout=timeout, max_queue=max_queue,
        cors_origins=cors_origins, cors_methods=cors_methods, cors_headers=cors_headers,
        cors_credentials=cors_credentials, log_requests=not log_disable,
        **_reasoning(reasoning, reasoning_format, template_kwargs, reasoning_preserve))
    _run(config, hosts, port)


def _reasoning(reasoning: str, fmt: str, kwargs: str | None, preserve: bool = True) -> dict:
    """--reasoning, --reasoning-format and --chat-template-kwargs, checked, as ServerConfig's
    fields."""
    from specli.toolcall import REASONING_FORMATS

    value = reasoning.strip().lower()
    on = {"on": "on", "true": "on", "1": "on", "enabled": "on", "off": "off", "false": "off",
          "0": "off", "disabled": "off", "auto": "auto"}.get(value)
    if on is None:
        raise UsageError(f"unknown value for -rea/--reasoning: {reasoning!r} (on, off or auto)")
    if fmt not in REASONING_FORMATS:
        raise UsageError(f"unknown value for --reasoning-format: {fmt!r} (one of "
                         f"{', '.join(REASONING_FORMATS)})")
    given: dict = {}
    if kwargs:
        try:
            given = json.loads(kwargs)
        except ValueError as e:
            raise UsageError(f"--chat-template-kwargs is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise UsageError("--chat-template-kwargs must be a JSON object, e.g. "
                             "'{\"enable_thinking\": false}'")
    if on == "on":
        given.setdefault("enable_thinking", True)
    if not preserve:  # on is chat.template_context's default
        given.setdefault("preserve_reasoning", False)
    return {"reasoning": on, "reasoning_format": fmt, "template_kwargs": given}


def _hosts(value: str, port: int) -> list[str]:
    """--host as llama-server parses it: comma-separated, each an address or a UNIX socket
    path ending in .sock; port 0 (any free port) with one TCP address only."""
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    if not hosts:
        raise UsageError("--host requires at least one address")
    if port == 0 and sum(not h.endswith(".sock") for h in hosts) > 1:
        raise UsageError("--port 0 is not supported with several TCP addresses")
    return hosts


def _template(value: str | None, path: Path | None, jinja: bool) -> str | None:
    """The chat template given on the command line (text, or a file's), checked as
    llama-server checks it: rendered once with a test message."""
    if value is not None and path is not None:
        raise UsageError("give --chat-template or --chat-template-file, not both")
    if path is not None:
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --chat-template-file {path}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    if value is None:
        return None
    from specli.backend import knows_template
    from specli.chat import template_context
    from specli.prompt import chat_renderer
    from specli.template_host import render_messages

    source, builtin = chat_renderer(value, jinja)
    try:
        if builtin is not None and not knows_template(value):  # given: no ChatML fallback
            raise UsageError("llama.cpp does not know this chat template")
        render_messages(source, [{"role": "user", "content": "test"}], builtin=builtin,
                        context={**template_context(), "functions": ""})
    except UsageError as e:
        note = "" if jinja else " (without --jinja only llama.cpp's built-in templates work)"
        raise UsageError(f"the supplied chat template is not supported: {e.message}{note}",
                         hint="`specli serve --list-chat-templates` lists the built-in names"
                         ) from None
    return value


def _keys(given: list[str], path: Path | None) -> list[str]:
    # an empty key (`--api-key "$KEY"` with KEY unset) would start the server open: refused,
    # as is an empty LLAMA_API_KEY, which click reads as no value at all
    env = os.environ.get("LLAMA_API_KEY")
    if any(not v.replace(",", "").strip() for v in given) or (
            not given and path is None and env is not None and not env.replace(",", "").strip()):
        where = "--api-key" if given else "LLAMA_API_KEY"
        raise UsageError(f"{where} is empty: the server would start without authentication",
                         hint="give the key, or leave the flag (and LLAMA_API_KEY) out to "
                         "serve without one")
    keys = [k.strip() for v in given for k in v.split(",") if k.strip()]
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise SpecliError(f"cannot read --api-key-file {path}: {e.strerror or e}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip()]
        if not keys:
            raise UsageError(f"--api-key-file {path} holds no key")
    return keys


def _listen(host: str, port: int, v6only: bool = False) -> socket.socket:
    """A bound socket: a UNIX one for a path ending in .sock (a stale socket file there is
    replaced, any other file refused), else TCP."""
    try:
        if host.endswith(".sock"):
            if os.path.exists(host):
                _stale(host)
                os.unlink(host)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(host)
            return sock
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on the
        # connections of a socket that says it is TCP. With Nagle on, a response's body
        # waited for the client's delayed ACK of its headers: 40 ms on every request of a
        # kept-alive connection, /health included
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Linux: accepted inherit
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6only:  # "::" beside other addresses: IPv6 only,
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as llama-server's
            # --host help says (alone it stays dual-stack, as cpp-httplib binds it)
        sock.bind(addr)
        return sock
    except OSError as e:
        raise SpecliError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                          hint="choose another --port or --host") from None


def _inherited(n: int) -> list[socket.socket]:
    """The listening sockets a server restarting in place handed itself (rpc.exec_self),
    if it did: the same addresses, with the clients that queued while it restarted."""
    from specli.rpc import INHERITED

    fds = [int(x) for x in os.environ.pop(INHERITED, "").split(",") if x.isdigit()]
    if len(fds) != n:
        for fd in fds:
            os.close(fd)
        return []
    socks = [socket.socket(fileno=fd) for fd in fds]
    for s in socks:
        s.set_inheritable(False)
    return socks


def _stale(path: str) -> None:
    """A socket file left by a server that is gone may be replaced; a live server's, or a
    file that is no socket, may not."""
    import stat

    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise SpecliError(f"cannot listen on {path}: a file that is not a socket is there",
                          hint="choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens (connection refused): stale
    finally:
        probe.close()
    raise SpecliError(f"cannot listen on {path}: another server is listening there",
                      hint="stop it, or choose another path")


def _run(config, hosts: list[str], port: int) -> None:
    socks = _inherited(len(hosts))
    try:
        tcp = sum(not h.endswith(".sock") for h in hosts)
        for host in hosts[len(socks):]:
            socks.append(_listen(host, port, v6only=tcp > 1))
    except SpecliError:
        for s in socks:
            s.close()
        raise

    def ready(slots: int) -> None:
        where = ", ".join(f"unix:{h}" if h.endswith(".sock") else
                          f"http://{'[' + h + ']' if ':' in h else h}:{s.getsockname()[1]}"
                          for h, s in zip(hosts, socks, strict=True))
        err.print(f"specli serve: listening on {where} ({config.model_id}, "
                  f"{'draft ' + Path(config.draft.path).name if config.draft else 'no draft'}"
                  f", {slots} slot{'s' * (slots != 1)})", markup=False)

    server, failure = serving(config, socks, ready)
    server.run(sockets=socks)  # a socket file stays behind: the next start replaces it
    if failure:
        e = failure[0]
        if isinstance(e, SpecliError):
            raise e
        raise SpecliError(f"the server could not load the models: {e}") from e


def serving(config, socks: list[socket.socket], on_ready: Callable[[int], None]
            ) -> tuple[uvicorn.Server, list[BaseException]]:
    """The app over `config` and the uvicorn server that runs it on `socks` with specli's
    connection layer, and the list a failure to load lands in (which ends the server):
    what `specli serve` runs, from its main thread (the tests run it from one of theirs)."""
    import uvicorn

    from specli.server import conn, create_app

    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def fatal(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_fatal=fatal, on_ready=on_ready)
    app.state.specli.listening = [s.fileno() for s in socks]

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGTERM, SIGINT: streams end now
            app.state.specli.stopping()
            # uvicorn's own handler also raises the signal again once the server is down
            # (exit 143 or 130); after a clean shutdown llama-server exits 0, which is what
            # a supervisor reads: a second Ctrl-C still ends it at once
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    conn.Guarded.max_open = conn.limit(conn.raise_fd_limit())
    # ws="none": no WebSocket route, and no upgrade that would take the connection from
    # Guarded (its count would never come back)
    server = Server(uvicorn.Config(app, http=conn.Guarded, ws="none", log_level="warning",
                                   timeout_keep_alive=30, timeout_graceful_shutdown=5))
    return server, failure


def names(value: str | None) -> tuple[str, ...]:
    """A comma-separated list (-a, --tags) as llama-server keeps it: a sorted set of the
    names, blanks dropped."""
    return tuple(sorted({a.strip() for a in (value or "").split(",") if a.strip()}))


def batch_policy(drafting: o.Drafting) -> o.Drafting:
    """serve drafts with --draft auto unless --draft K was given (fixed, as llama-server's)
    or a draft tree was asked for: the slots' k is planned for the whole batch each step, 0
    where plain batched decoding makes more tokens a second (issue 56)."""
    p = drafting.params
    if p.cap_ngram or p.adaptive or p.n_seq > 1:  # --draft K or auto given, or a tree
        return drafting
    return replace(drafting, params=replace(p, adaptive=True, n_max=config.DRAFT_AUTO_MAX))

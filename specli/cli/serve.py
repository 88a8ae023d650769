"""`specli serve`: an OpenAI-compatible HTTP server with speculative decoding (llama-server -md)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer

from specli.cli import options as o
from specli.cli.console import err
from specli.config import SamplingParams
from specli.errors import SpecliError, UsageError

SERVER = "Server"


@o.grouped
def serve(
    models: o.ModelFiles = o.MODEL_FILES,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on. 0.0.0.0 exposes the server to the network.",
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
        "--jinja/--no-jinja", help="Accepted for llama-server's command lines: specli always "
        "renders the GGUF's Jinja chat template (sandboxed).", envvar="LLAMA_ARG_JINJA",
        rich_help_panel=SERVER)] = True,
    timeout: Annotated[float, typer.Option(
        "-to", "--timeout", help="Seconds a request may wait for a free slot before a 503.",
        envvar="LLAMA_ARG_TIMEOUT", rich_help_panel=SERVER)] = 600.0,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", help="Requests that may wait for a slot; one more gets a 503 with "
        "Retry-After.", rich_help_panel=SERVER)] = 16,
    alias: Annotated[str | None, typer.Option(
        "-a", "--alias", help="Model name in /v1/models and responses. Default: the file name.",
        envvar="LLAMA_ARG_ALIAS",
        rich_help_panel=SERVER, show_default=False)] = None,
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

    /v1/chat/completions, /v1/completions, /v1/models, /completion, /props, /health and (with
    --metrics) /metrics. A request may carry its own `speculative` object ({"n_max", "n_min",
    "p_min", "type"}, or false). With no -m, the embedded SmolLM2 pair is served.
    """
    if parallel < 1 or max_queue < 0 or timeout <= 0:
        raise UsageError("-np/--parallel must be at least 1, --max-queue at least 0 and "
                         "--timeout more than 0")
    if n_predict < -1 or n_predict == 0:
        raise UsageError(f"-n/--n-predict must be -1 or at least 1, got {n_predict}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    types = list(drafting.types)
    if drafting.ngram.lookup_dynamic and parallel > 1:
        raise UsageError("-lcd/--lookup-cache-dynamic with --parallel > 1: each slot would "
                         "overwrite the others' cache", hint="use -lcs, or -np 1")
    model, model_draft = models.resolve()
    if "draft-simple" in types and model_draft is None:
        raise UsageError("--spec-type draft-simple needs a draft model", hint="add -md FILE")
    keys = _keys(api_key or [], api_key_file)

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpecliError("specli serve needs the server extra",
                          hint="pip install 'specli[server]'") from None
    from specli.engine import check_files
    from specli.server import ServerConfig

    target, draft_model = resources.model_params(model, model_draft, verbose=verbose, gpu=gpu)
    check_files(target, draft_model, types)  # a bad pair or file is refused before listening
    config = ServerConfig(
        target=target, draft=draft_model,
        draft_params=drafting.params, spec_types=tuple(types), ngram=drafting.ngram,
        sampling=sampling,
        n_predict=n_predict, parallel=parallel, api_keys=tuple(keys), alias=alias,
        metrics=metrics, slots=slots, timeout=timeout, max_queue=max_queue,
        cors_origins=cors_origins, cors_methods=cors_methods, cors_headers=cors_headers,
        cors_credentials=cors_credentials)
    _run(config, host, port)


def _keys(given: list[str], path: Path | None) -> list[str]:
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


def _run(config, host: str, port: int) -> None:
    import uvicorn

    from specli.server import create_app

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise SpecliError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                          hint="choose another --port or --host") from None
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    def fatal(e: BaseException) -> None:
        failure.append(e)
        if server is not None:
            server.should_exit = True

    def ready(slots: int) -> None:
        bound = sock.getsockname()
        err.print(f"specli serve: listening on http://{host}:{bound[1]} ({config.model_id}, "
                  f"{'draft ' + Path(config.draft.path).name if config.draft else 'no draft'}"
                  f", {slots} slot{'s' * (slots != 1)})", markup=False)

    app = create_app(config, on_fatal=fatal, on_ready=ready)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30,
                                           timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    if failure:
        e = failure[0]
        if isinstance(e, SpecliError):
            raise e
        raise SpecliError(f"the server could not load the models: {e}") from e

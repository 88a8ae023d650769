"""`specli serve`: an OpenAI-compatible HTTP server with speculative decoding (llama-server -md)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer

from specli.cli import options as o
from specli.cli.console import err
from specli.errors import SpecliError, UsageError

SERVER = "Server"


@o.gpu_flags
def serve(
    model: o.Model = None,
    model_draft: o.ModelDraft = None,
    hf_repo: o.HfRepo = None,
    hf_file: o.HfFile = None,
    hf_repo_draft: o.HfRepoDraft = None,
    hf_file_draft: o.HfFileDraft = None,
    hf_token: o.HfToken = None,
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
    spec_type: o.SpecTypeOpt = None,
    ngram_size_n: o.NgramSizeN = None,
    ngram_size_m: o.NgramSizeM = None,
    ngram_min_hits: o.NgramMinHits = None,
    simple_size_n: o.SimpleSizeN = None,
    simple_size_m: o.SimpleSizeM = None,
    simple_min_hits: o.SimpleMinHits = None,
    map_k_size_n: o.MapKSizeN = None,
    map_k_size_m: o.MapKSizeM = None,
    map_k_min_hits: o.MapKMinHits = None,
    map_k4v_size_n: o.MapK4vSizeN = None,
    map_k4v_size_m: o.MapK4vSizeM = None,
    map_k4v_min_hits: o.MapK4vMinHits = None,
    ngram_mod_n_match: o.NgramModMatch = 24,
    ngram_mod_n_max: o.NgramModMax = 64,
    ngram_mod_n_min: o.NgramModMin = 48,
    lookup_cache_static: o.LookupStatic = None,
    lookup_cache_dynamic: o.LookupDynamic = None,
    draft: o.DraftMax = None,
    draft_min: o.DraftMin = 0,
    draft_p_min: o.DraftPMin = 0.0,
    temp: o.Temp = 0.8,
    top_k: o.TopK = 40,
    top_p: o.TopP = 0.95,
    min_p: o.MinP = 0.05,
    seed: o.Seed = -1,
    ctx_size: o.CtxSize = o.DEFAULTS["ctx"],
    ctx_size_draft: o.CtxSizeDraft = None,
    n_gpu_layers: o.GpuLayers = 0,
    n_gpu_layers_draft: o.GpuLayersDraft = 0,
    threads: o.Threads = o.DEFAULTS["threads"],
    threads_draft: o.ThreadsDraft = None,
    threads_batch: o.ThreadsBatch = None,
    threads_batch_draft: o.ThreadsBatchDraft = None,
    cache_type_k: o.CacheTypeK = None,
    cache_type_v: o.CacheTypeV = None,
    cache_type_k_draft: o.CacheTypeKDraft = None,
    cache_type_v_draft: o.CacheTypeVDraft = None,
    flash_attn: o.FlashAttnOpt = o.FlashAttn.auto,
    verbose: o.Verbose = False,
    gpu: o.GpuFlags | None = None,
) -> None:
    """Serve the target over HTTP (OpenAI and llama-server routes) with speculative decoding.

    /v1/chat/completions, /v1/completions, /v1/models, /completion, /props, /health and (with
    --metrics) /metrics. A request may carry its own `speculative` object ({"n_max", "n_min",
    "p_min", "type"}, or false). With no -m, the embedded SmolLM2 pair is served.
    """
    dp = o.draft_params(draft, draft_min, draft_p_min)
    sampling = o.sampling(temp, top_k, top_p, min_p, seed)
    o.check_ranges(n_predict, ctx_size, threads)
    if parallel < 1 or max_queue < 0 or timeout <= 0:
        raise UsageError("-np/--parallel must be at least 1, --max-queue at least 0 and "
                         "--timeout more than 0")
    if n_predict < -1 or n_predict == 0:
        raise UsageError(f"-n/--n-predict must be -1 or at least 1, got {n_predict}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    ngram = o.ngram_params(ngram_size_n, ngram_size_m, ngram_min_hits, simple_size_n,
                           simple_size_m, simple_min_hits, map_k_size_n, map_k_size_m,
                           map_k_min_hits, map_k4v_size_n, map_k4v_size_m, map_k4v_min_hits,
                           ngram_mod_n_match, ngram_mod_n_max, ngram_mod_n_min,
                           lookup_cache_static, lookup_cache_dynamic)
    types = o.spec_types(spec_type, lookup_cache_static, lookup_cache_dynamic)
    if lookup_cache_dynamic and parallel > 1:
        raise UsageError("-lcd/--lookup-cache-dynamic with --parallel > 1: each slot would "
                         "overwrite the others' cache", hint="use -lcs, or -np 1")
    from specli.cli.download import resolve_models

    model, model_draft = resolve_models(model, model_draft, hf_repo, hf_file, hf_repo_draft,
                                        hf_file_draft, hf_token)
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

    target, draft_model = o.model_params(
        model, model_draft, ctx=ctx_size, ctx_draft=ctx_size_draft, ngl=n_gpu_layers,
        ngld=n_gpu_layers_draft, threads=threads, threads_draft=threads_draft,
        threads_batch=threads_batch, threads_batch_draft=threads_batch_draft, ctk=cache_type_k,
        ctv=cache_type_v, ctkd=cache_type_k_draft, ctvd=cache_type_v_draft,
        flash_attn=flash_attn, verbose=verbose, gpu=gpu)
    check_files(target, draft_model, types)  # a bad pair or file is refused before listening
    config = ServerConfig(
        target=target, draft=draft_model,
        draft_params=dp, spec_types=tuple(types), ngram=ngram, sampling=sampling,
        n_predict=n_predict, parallel=parallel, api_keys=tuple(keys), alias=alias,
        metrics=metrics, timeout=timeout, max_queue=max_queue)
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

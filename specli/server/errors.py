"""Errors in OpenAI's envelope {"error": {"message", "type", "param", "code"}}: bad input is
a 4xx, never a 500; a 5xx is a bug or a failed decode."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specli.errors import BackendError, ContextOverflowError, SpecliError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers
        self.extra = extra or {}  # more fields in the error object (llama-server's)


def overflow(message: str, n_prompt_tokens: int, n_ctx: int,
             param: str | None = None) -> APIError:
    """A prompt the context cannot hold, in llama-server's form (its type, n_prompt_tokens
    and n_ctx) with OpenAI's code."""
    return APIError(400, message, "exceed_context_size_error", param=param,
                    code="context_length_exceeded",
                    extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx})


class _Ascii(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote a client's own string,
    and a lone surrogate in it cannot be written as UTF-8."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


MAX_MESSAGE, MAX_PARAM = 1000, 120  # an error quotes at most this much of a client's input


def clip(text: str, limit: int = 80) -> str:
    """A client's own string as an error quotes it: at most `limit` characters and a count of
    the rest, so that an error is never larger than a short note (a 5 MB key is a name)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more " \
        "characters)"


def envelope(status: int, message: str, type: str = "invalid_request_error",
             param: str | None = None, code: str | int | None = None,
             headers: dict[str, str] | None = None, extra: dict | None = None) -> JSONResponse:
    return _Ascii({"error": {"message": clip(message, MAX_MESSAGE), "type": type,
                             "param": None if param is None else clip(param, MAX_PARAM),
                             "code": code, **(extra or {})}}, status_code=status,
                  headers=headers)


def unavailable(e: SpecliError) -> APIError:
    """Every helper process of a pool (grammar checkers, template renderers) stayed busy."""
    return APIError(503, e.message, "unavailable_error", code="unavailable",
                    headers={"Retry-After": "5"})


def refuse(param: str, why: str = "is not supported by specli") -> APIError:
    return APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


def install(app: FastAPI) -> None:
    """Answer every kind of error in the envelope."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return envelope(e.status, e.message, e.type, e.param, e.code, e.headers, e.extra)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param, code = describe(list(e.errors()))
        return envelope(400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 400 and "parsing the body" in str(e.detail):
            return envelope(400, "the body is not valid JSON", code="invalid_json")
        kind, code = {404: ("not_found_error", "not_found"),
                      405: ("invalid_request_error", "method_not_allowed")}.get(
            e.status_code, ("invalid_request_error", None))
        return envelope(e.status_code, str(e.detail), kind, code=code,
                        headers=getattr(e, "headers", None))

    @app.exception_handler(SpecliError)
    async def specli_error(request: Request, e: SpecliError) -> JSONResponse:
        if isinstance(e, BackendError):
            return envelope(500, e.message, "server_error")
        if isinstance(e, ContextOverflowError):
            o = overflow(e.message, e.n_prompt_tokens, e.n_ctx)
            return envelope(400, o.message, o.type, code=o.code, extra=o.extra)
        return envelope(400, e.message)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        return envelope(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# -- a body that failed validation, in the API's own terms ------------------------------------

_EXPECT = {
    "string_type": "a string", "int_type": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "bool_type": "a boolean", "list_type": "an array",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
    "none_required": "null",
}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_tag(part) -> bool:
    """A union member's tag in a pydantic error location ('str', 'list[TextPart]',
    'constrained-int', 'Speculative'), not one of the request's own field names."""
    return isinstance(part, str) and (part in _TYPE_NAMES or part[:1].isupper()
                                      or any(c in part for c in "[-("))


def _where(loc) -> str:
    """messages[0].content, from pydantic's ('body', 'messages', 0, 'content', 'str')."""
    out = ""
    for part in loc:
        if (part == "body" and not out) or _is_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def describe(errors: list[dict]) -> tuple[str, str | None, str]:
    """(message, param, code) for a body that failed validation: the field as the client
    wrote it (messages[0].content) and what it must be, never pydantic's internals."""
    first = errors[0] if errors else {}
    where, kind = _where(first.get("loc", ())), first.get("type", "")
    if kind == "json_invalid":
        return "the body is not valid JSON", None, "invalid_json"
    if not where and kind in ("missing", "model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None, "invalid_json"
    if kind == "extra_forbidden":  # the last place is the client's own key, as written
        loc = tuple(first.get("loc", ()))
        parent = _where(loc[:-1])
        key = clip(f"{parent}.{loc[-1]}" if parent else str(loc[-1]) if loc else "")
        return f"unknown parameter '{key}'", key, "unknown_parameter"
    if kind == "missing":
        return f"'{where}' is required", where, "missing"
    here = [e for e in errors if _where(e.get("loc", ())) == where]
    long = next((e for e in here if e.get("type") == "too_long"), None)
    if long is not None:  # a list of the right type, too long: say the limit, not the type
        most = (long.get("ctx") or {}).get("max_length")
        got = (long.get("ctx") or {}).get("actual_length")
        what = long.get("msg") or ""  # schemas' own count (parts in all), or pydantic's
        what = what if what.startswith("too many ") else "too many items"
        return (f"{where} has {what}: at most {most}"
                + (f", got {got}" if got is not None else ""), where, "too_long")
    deeper = [e for e in errors if _where(e.get("loc", ())).startswith((f"{where}[", f"{where}."))]
    if deeper:  # a union matched by type deeper down: the part inside that failed says more
        return describe(deeper)
    wants = list(dict.fromkeys(_EXPECT[e.get("type", "")] for e in errors
                               if _where(e.get("loc", ())) == where
                               and e.get("type", "") in _EXPECT))
    if wants and kind in _EXPECT:
        return f"{where or 'the body'} must be {' or '.join(wants)}", where or None, \
            "invalid_type"
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return (f"{where}: {msg[:1].lower()}{msg[1:]}" if where else msg), where or None, \
        "invalid_value"

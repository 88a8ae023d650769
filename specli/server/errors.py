"""Errors in OpenAI's envelope {"error": {"message", "type", "param", "code"}}: bad input is
a 4xx, never a 500; a 5xx is a bug or a failed decode."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specli.errors import BackendError, SpecliError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


def envelope(status: int, message: str, type: str = "invalid_request_error",
             param: str | None = None, code: str | int | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def refuse(param: str, why: str = "is not supported by specli") -> APIError:
    return APIError(400, f"{param} {why}", param=param, code="unsupported_parameter")


def install(app: FastAPI) -> None:
    """Answer every kind of error in the envelope."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return envelope(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        kind = err.get("type", "")
        if kind == "json_invalid":
            return envelope(400, "the body is not valid JSON", code="invalid_json")
        if kind == "extra_forbidden":
            return envelope(400, f"unknown parameter '{param}'", param=param,
                            code="unknown_parameter")
        if loc == [] and kind in ("model_attributes_type", "dict_type"):
            return envelope(400, "the request body must be a JSON object", code="invalid_json")
        if kind == "missing":
            return envelope(400, f"'{param}' is required", param=param, code="missing")
        return envelope(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param=param,
                        code="invalid_value")

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
        return envelope(400, e.message)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        return envelope(500, f"internal error: {type(e).__name__}: {e}", "server_error")

"""The endpoint's HTTP layer: the FastAPI application its routes hang on (:class:`cluster.serve.Completions`), the
middleware that checks a request's key and body size before anything reads it, and the handlers that answer every
error in OpenAI's shape (the shapes themselves: :mod:`cluster.openai_api`)."""

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.openai_api import HTTPError, error_body

app = FastAPI(title="DistillSpec speculative decoding", version="1")
#: this replica's ``serve.api_key`` and ``serve.limits.max_body_bytes`` (one replica per process)
_guard: dict[str, Any] = {"key": None, "max_body_bytes": None}


def guard(key: str | None, max_body_bytes: int | None = None) -> None:
    """Make this process's routes answer only requests with ``key`` (None: every request) and bodies of at most
    ``max_body_bytes``. A function of this module, so that the deployment, which Ray ships to its replica by value,
    sets the globals the middleware reads."""
    _guard.update(key=key or None, max_body_bytes=max_body_bytes)


class _BodyLimit:
    """A body over ``serve.limits.max_body_bytes`` gets a 413: by its Content-Length before a byte of it is read,
    or, sent without one (chunked), as soon as what arrived passes the limit (what arrives before is buffered, then
    replayed to the route). Runs after the key check."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        limit = _guard["max_body_bytes"]
        if scope["type"] != "http" or not limit:
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit():
            if int(length) > limit:
                return await _too_large(limit)(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > limit:
                return await _too_large(limit)(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def _too_large(limit: int) -> JSONResponse:
    message = f"the request body is larger than this server's limit of {limit} bytes (serve.limits.max_body_bytes)"
    return JSONResponse(status_code=413, content=error_body(message, None))


app.add_middleware(_BodyLimit)  # added first: it runs inside the key check below


@app.middleware("http")
async def _require_key(request: Request, call_next):
    """With ``serve.api_key``, every route (``/docs`` and ``/openapi.json`` too) answers 401 to a request without the
    key, before its body is read: an unauthenticated client learns nothing of the schema and costs no parsing."""
    if (key := _guard["key"]) is not None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):
            message = "missing or wrong API key (Authorization: Bearer ...)"
            return JSONResponse(status_code=401, content=error_body(message, None, "authentication_error"))
    return await call_next(request)


@app.exception_handler(RequestValidationError)
async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return JSONResponse(status_code=400, content=error_body("the request body is not valid JSON", None))
    param = loc[0] if loc else None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown or unsupported field"
    return JSONResponse(status_code=400, content=error_body(message, param))


@app.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405), ...: OpenAI's error shape, as on every route."""
    message = {
        404: f"no route {request.method} {request.url.path}: this server serves /v1/completions, "
        "/v1/chat/completions, /v1/models and /v1/stats",
        405: f"{request.method} is not allowed on {request.url.path}",
    }
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        status_code=exc.status_code,
        content=error_body(message.get(exc.status_code, str(exc.detail)), None, kind),
        headers=getattr(exc, "headers", None),
    )


@app.exception_handler(HTTPError)
async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:
    content = error_body(exc.message, exc.param, exc.kind)
    return JSONResponse(status_code=exc.status, content=content, headers=exc.headers)

"""OpenAI-style errors: every failure an llaunch HTTP app (frontend, pd_master, config server) reports is
`{"error": {message, type, param, code}}`."""
from __future__ import annotations

import logging
from typing import Optional

import msgspec
from quart import Response

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the frontend refuses or cannot finish; the handler turns it into a JSON response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                    code="invalid_api_key")


def draining() -> ApiError:
    return ApiError(503, "The server is shutting down and accepts no new requests.",
                    type="service_unavailable", code="draining")


RETRY_AFTER_S = 1  # every 503's hint to clients (runtime/web/guards.py adds it where missing)


def engine_failed(reason: str, detail: Optional[str] = None) -> ApiError:
    """The error a request ends with when the engine ends it with `reason` (not stop or length)."""
    if reason == "invalid":
        return ApiError(400, detail or "The engine refused the request.", code="invalid_request")
    if reason == "overloaded":
        return ApiError(503, detail or "The server is at capacity; retry later.", type="service_unavailable",
                        code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if reason == "timeout":
        return ApiError(504, detail or "The request ran out of time.", type="timeout", code="timeout")
    if reason in ("stalled", "shutdown"):
        return ApiError(503, detail or f"The engine cannot finish the request ({reason}).",
                        type="service_unavailable", code=reason)
    suffix = f": {detail}" if detail else ""
    return ApiError(500, f"The engine could not finish the request ({reason}){suffix}.", type="server_error",
                    code=reason)


def stream_error(e: Exception) -> ApiError:
    """What a stream that failed part-way tells its client in its last event: the ApiError it failed
    with, or for anything unexpected (a bug: logged with its traceback) a 500 that says so."""
    if isinstance(e, ApiError):
        return e
    log.exception("a stream failed part-way")
    return ApiError(500, f"Internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error")


def json_response(payload: object, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json", headers=headers)


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), status=error.status, headers=error.headers)

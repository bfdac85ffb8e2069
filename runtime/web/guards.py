"""What every llaunch HTTP app (frontend, pd_master, config server) does around its routes: errors
as OpenAI-style JSON (never an HTML page), and the API-key and drain checks before a route runs."""
from __future__ import annotations

import hmac
import logging
from typing import Optional

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from llaunch.runtime.web.errors import RETRY_AFTER_S, ApiError, draining, error_response, unauthorized
from llaunch.runtime.web.lifecycle import Lifecycle


def json_errors(app: Quart, log: logging.Logger) -> None:
    """ApiError, HTTP errors (404, 405, ...) and anything unexpected answer as JSON errors; every 503
    (draining, overloaded, not ready, stalled) tells the client when to come back (Retry-After)."""

    @app.after_request
    async def retry_after(response: Response) -> Response:
        if response.status_code == 503 and "Retry-After" not in response.headers:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.errorhandler(ApiError)
    async def api_error(e: ApiError) -> Response:
        return error_response(e)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        kind = "not_found_error" if e.code == 404 else "invalid_request_error"
        return error_response(ApiError(e.code or 500, f"{e.name}: {request.method} {request.path}", type=kind))

    @app.errorhandler(Exception)
    async def internal_error(e: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, f"Internal error: {type(e).__name__}: {e}", type="server_error"))


def gatekeeper(app: Quart, api_key: Optional[str], lifecycle: Lifecycle, open_paths: tuple[str, ...],
               drain_exempt: tuple[str, ...]) -> None:
    """Refuse a request without the API key (except on `open_paths`), and new work while draining
    (except on `drain_exempt`)."""

    @app.before_request
    async def check() -> Optional[Response]:
        if api_key and request.path not in open_paths:
            given = request.headers.get("Authorization", "")
            anthropic = request.headers.get("x-api-key", "")  # where Anthropic's clients send the key
            if not (hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())
                    or hmac.compare_digest(anthropic.encode(), api_key.encode())):
                return error_response(unauthorized())
        if lifecycle.draining and request.path not in drain_exempt:
            return error_response(draining())
        return None

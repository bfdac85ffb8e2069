"""OpenAI-style errors: every failure the frontend reports is `{"error": {message, type, param, code}}`."""
from __future__ import annotations

from typing import Optional

import msgspec
from quart import Response


class ApiError(Exception):
    """A request the frontend refuses or cannot finish; the handler turns it into a JSON response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key")


def draining() -> ApiError:
    return ApiError(503, "The server is shutting down and accepts no new requests.",
                    type="service_unavailable", code="draining")


def engine_failed(reason: str) -> ApiError:
    return ApiError(500, f"The engine could not finish the request ({reason}).", type="server_error",
                    code=reason)


def json_response(payload: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type="application/json")


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), status=error.status)

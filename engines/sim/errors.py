"""Errors in vLLM's own JSON shape, so clients see one error format."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered to the client as vLLM's ErrorResponse."""

    def __init__(
        self, status: int, message: str, err_type: str | None = None, *, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _TYPES.get(status, "InternalServerError")
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.err_type, self.param)


class RequestValidationError(ApiError):
    """The body failed vLLM's pydantic schema, so FastAPI answered 400 before the handler ran.

    Nothing of the request reached the engine: unlike an ApiError raised inside the handler,
    it does not release a prefill's KV (see `Connector.reject`).
    """

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def error_body(
    status: int, message: str, err_type: str | None = None, param: str | None = None
) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as vLLM's ErrorResponse."""
    kind = err_type or _TYPES.get(status, "InternalServerError")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


class KVTransferError(Exception):
    """A decode could not get its KV and must not be served (e.g. a push never came).

    Answered as HTTP 500 (non-streaming) or as an error event in a 200 stream, as vLLM does
    when a request fails inside the engine.
    """


class EngineDeadError(Exception):
    """The engine core died serving a request (vLLM's ``EngineDeadError``): this request
    fails as a KV transfer failure does, every later one with 500, and /health with 503."""

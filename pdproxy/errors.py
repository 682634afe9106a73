"""pdproxy's error tree; every error that leaves the proxy is OpenAI-shaped JSON.

    ProxyError                      any failure the proxy reports to a client
    ├── BadRequest            400   the client's body or headers are unusable
    │   ├── UnsupportedMediaType 415
    │   ├── PayloadTooLarge   413
    │   └── HeadTooLarge      431   a request head past --max-request-head-bytes
    (pdproxy.runtime.listener) ├── ClientTimeout         408   a request head or body not sent in
    time (pdproxy.runtime.listener) ├── TooManyConnections    503   every client connection busy at
    the cap (Retry-After) ├── Unauthorized          401   no or a wrong client API key
    ├── Overloaded            429   past --max-concurrent-requests and its queue (Retry-After)
    ├── LoopDetected          508   the request carries this pdproxy's own hop (Via)
    ├── ModelNotFound         404   no instance serves the request's model (vLLM's 404)
    ├── RequestIdInUse        409   a push transfer with this X-Request-Id is in flight
    ├── NoEndpointAvailable   503   no routable prefill or decode instance
    │   └── ShuttingDown      503   the proxy is draining
    ├── UpstreamError               an engine leg failed
    │   ├── UpstreamConnectError 503  could not connect; nothing was sent (retry-safe)
    │   │   └── UpstreamRequestError 503  the leg's request could not be built (the same)
    │   ├── UpstreamTimeout   504   no answer in time; the request may have run
    │   ├── UpstreamProtocolError 502  broken or truncated answer
    │   │   └── UpstreamServerError 502  a prefill answered 5xx (its body is not relayed)
    │   └── UpstreamStatusError  (engine status)  the engine answered non-2xx
    ├── AdminError                  the admin API refused a call (401/403/400/409)
    ConfigError                     invalid configuration (never reaches a client)
    RegistryMessageError            a bad registration message (logged, never answered)

``UpstreamStatusError`` carries the engine's own status and body so the client sees
exactly what the engine said.
"""

from __future__ import annotations

from typing import ClassVar

ECHO_LIMIT = 256  # characters of a client's string an error message repeats at most


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` as an error message may echo it: at most ``limit`` characters, the rest
    counted, never repeated (a client's 200 KB model name is not sent back whole)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class ProxyError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


class BadRequest(ProxyError):
    status = 400
    error_type = "BadRequestError"


class UnsupportedMediaType(BadRequest):
    status = 415
    error_type = "UnsupportedMediaTypeError"


class PayloadTooLarge(BadRequest):
    status = 413
    error_type = "PayloadTooLargeError"


class HeadTooLarge(BadRequest):
    status = 431
    error_type = "RequestHeaderFieldsTooLargeError"


class ClientTimeout(ProxyError):
    status = 408
    error_type = "RequestTimeoutError"


class TooManyConnections(ProxyError):
    status = 503
    error_type = "ServiceUnavailableError"


class Unauthorized(ProxyError):
    status = 401
    error_type = "AuthenticationError"


class Overloaded(ProxyError):
    """Admission control refused the request; ``retry_after`` seconds go in Retry-After."""

    status = 429
    error_type = "RateLimitError"

    def __init__(
        self,
        message: str,
        *,
        retry_after: int = 1,
        headers: tuple[tuple[str, str], ...] = (),
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.headers = headers  # more response headers (a tenant's ``x-ratelimit-*``)
        self.code = code  # OpenAI's error code, e.g. "rate_limit_exceeded"

    def to_dict(self) -> dict[str, object]:
        body = super().to_dict()
        if self.code is not None:
            error = body["error"]
            assert isinstance(error, dict)
            error["code"] = self.code
        return body


class LoopDetected(ProxyError):
    """The request arrived with this pdproxy's own hop marker: one of its own legs,
    routed back to it (RFC 5842's 508)."""

    status = 508
    error_type = "LoopDetectedError"


class ModelNotFound(ProxyError):
    """No instance of the fleet serves the request's ``model``: vLLM's own 404, answered
    without contacting an engine."""

    status = 404
    error_type = "NotFoundError"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{clip(model)}` does not exist.", param="model")


class RequestIdInUse(ProxyError):
    """A push transfer with this ``X-Request-Id`` is in flight: the prefill pairs the legs
    by id, so two requests sharing one could swap their KV (``--kv-connector nixl-push``)."""

    status = 409
    error_type = "ConflictError"


class NoEndpointAvailable(ProxyError):
    status = 503
    error_type = "ServiceUnavailableError"


class ShuttingDown(NoEndpointAvailable):
    pass


class UpstreamError(ProxyError):
    status = 502
    error_type = "BadGatewayError"

    def __init__(self, message: str, *, leg: str) -> None:
        super().__init__(message)
        self.leg = leg


class EngineErrorEvent(UpstreamError):
    """The decode engine streamed its own error event mid-stream (vLLM's
    ``data: {"error": {...}}``, then ``[DONE]``): the stream is cut there and a resumable
    one migrates; one that cannot gets ``event``, the engine's own event, once."""

    def __init__(self, event: bytes) -> None:
        super().__init__("decode engine sent an error event mid-stream", leg="decode")
        self.event = event

    def sse(self) -> bytes:
        """The engine's event, ended with ``[DONE]`` as vLLM ends it."""
        event = self.event.rstrip() + b"\n\n"
        return event if event.endswith(b"data: [DONE]\n\n") else event + b"data: [DONE]\n\n"


class UpstreamConnectError(UpstreamError):
    status = 503
    error_type = "ServiceUnavailableError"


class UpstreamRequestError(UpstreamConnectError):
    """The leg's request could not be built from what the instance registered (a header
    it cannot carry): nothing was sent. It counts against that instance, as a connect
    failure does, and is retried elsewhere."""


class UpstreamTimeout(UpstreamError):
    status = 504
    error_type = "GatewayTimeoutError"


class UpstreamProtocolError(UpstreamError):
    pass


class UpstreamServerError(UpstreamProtocolError):
    """A prefill answered 5xx: the client gets 502, never the prefill's body, so it cannot
    mistake the prefill's failure for a verdict on its own request."""

    def __init__(self, *, leg: str, status: int) -> None:
        super().__init__(f"{leg} engine answered HTTP {status}", leg=leg)
        self.engine_status = status


class UpstreamStatusError(UpstreamError):
    """The engine answered non-2xx; ``body`` and ``content_type`` are relayed as they came."""

    def __init__(self, *, leg: str, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{leg} engine answered HTTP {status}", leg=leg)
        self.engine_status = status
        self.body = body
        self.content_type = content_type


class ConfigError(Exception):
    """Invalid configuration; the CLI turns it into exit status 2."""


class AdminError(ProxyError):
    """The admin API refused a call; ``status`` is set per instance."""

    error_type = "AdminError"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[misc]


class RegistryMessageError(Exception):
    """A registration message that cannot be used; counted and logged, never answered."""

"""Errors that cross a boundary, each tied to one documented status code.

Every layer raises these; the router maps them to gRPC status codes and HTTP statuses in one
place. Anything else that escapes is a bug and is reported as INTERNAL / 500.
"""

from __future__ import annotations


class PdServeError(Exception):
    """Base class. `grpc_code` names a `grpc.StatusCode` member; `http_status` is the HTTP code."""

    grpc_code = "INTERNAL"
    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):
        # Errors cross Ray process boundaries; keep `param` when they are pickled.
        return (_rebuild, (type(self), self.message, self.param))


def _rebuild(cls: type[PdServeError], message: str, param: str | None) -> PdServeError:
    return cls(message, param=param)


class InvalidArgument(PdServeError):
    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class NotFound(PdServeError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"


class Unauthenticated(PdServeError):
    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"


class ResourceExhausted(PdServeError):
    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    error_type = "rate_limit_error"


class DeadlineExceeded(PdServeError):
    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    error_type = "timeout_error"


class Unavailable(PdServeError):
    """Transient: the caller may retry."""

    grpc_code = "UNAVAILABLE"
    http_status = 503
    error_type = "service_unavailable"


class FailedPrecondition(PdServeError):
    """The two pools disagree on the KV layout, or a lease is no longer valid."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 409
    error_type = "failed_precondition"

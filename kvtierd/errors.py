"""Errors the core raises for bad requests, each naming the gRPC status it maps to.

Asserts guard kvtierd's own invariants; everything a caller can get wrong raises one of these,
before anything has changed (a bad request changes nothing).
"""


class KvtierError(Exception):
    """Base of the errors a caller can cause. `code` is the gRPC status name it maps to."""

    code = "UNKNOWN"


class InvalidArgument(KvtierError, ValueError):
    """Malformed input: a bad hash length, a block id out of range, tokens that do not fill a block."""

    code = "INVALID_ARGUMENT"


class NotFound(KvtierError, KeyError):
    """The named request, session or block is not known."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(KvtierError):
    """The request is well formed but the state forbids it (wrong layout, releasing what you do not hold)."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(KvtierError):
    """Something is full; the message says what."""

    code = "RESOURCE_EXHAUSTED"


class Unauthenticated(KvtierError):
    """The call carries no credential, or one the daemon does not know."""

    code = "UNAUTHENTICATED"


class PermissionDenied(KvtierError):
    """The credential is valid but does not allow this (a session of another tenant)."""

    code = "PERMISSION_DENIED"


class Unavailable(KvtierError):
    """The daemon cannot be reached (not running, wrong address, shutting down)."""

    code = "UNAVAILABLE"


class DeadlineExceeded(KvtierError):
    """The call did not finish within its timeout."""

    code = "DEADLINE_EXCEEDED"


ERRORS_BY_CODE: dict[str, type[KvtierError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted,
                              Unauthenticated, PermissionDenied, Unavailable, DeadlineExceeded)
}

# How a draining daemon's UNAVAILABLE details begin (the client then gives no "is it running?" hint).
DRAINING_DETAILS = "this daemon is draining"

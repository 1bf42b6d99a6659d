"""The errors every layer may raise, as plain Python classes: no gRPC, no torch. shared.rpc.errors maps each to a
gRPC status (and the router's HTTP layer to an HTTP status) in one place."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input from a client; maps to INVALID_ARGUMENT at the gRPC edge."""


class EngineDead(RuntimeError):
    """The engine thread stopped; maps to UNAVAILABLE."""


class Overloaded(RuntimeError):
    """Too many requests in flight; maps to RESOURCE_EXHAUSTED."""


class RateLimited(Overloaded):
    """A caller over its requests or tokens per minute; RESOURCE_EXHAUSTED (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unauthenticated(RuntimeError):
    """No API key, or a wrong one, where the server requires one; maps to UNAUTHENTICATED (HTTP 401)."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing                      # no key at all (OpenAI's body then has no error code)


class PeerUnavailable(RuntimeError):
    """A service this one depends on cannot be reached; maps to UNAVAILABLE."""


class Draining(RuntimeError):
    """This service is shutting down (SIGTERM): in-flight work finishes, new work is refused; maps to UNAVAILABLE
    (HTTP 503), which clients retry elsewhere."""


class NotRunning(LookupError):
    """A request id this service does not run (an attach to a request that ended or never began); NOT_FOUND."""


class NotConfigured(RuntimeError):
    """A call this service is not set up for (blocks sent to a target that keeps no host tier);
    FAILED_PRECONDITION."""


class Forbidden(PermissionError):
    """A request this service may not carry out for the caller (a target outside the draft's allow-list);
    PERMISSION_DENIED."""

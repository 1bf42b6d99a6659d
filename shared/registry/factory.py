"""Open the registry backend a URL names: a dict lookup on the scheme, not an if-ladder."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from shared.config import redact_url
from shared.registry.base import DEFAULT_LEASE_S, PrefixRegistry


def _memory(url: str, lease_s: float) -> PrefixRegistry:
    from shared.registry.memory import MemoryRegistry

    return MemoryRegistry(lease_s)


def _redis(url: str, lease_s: float) -> PrefixRegistry:
    from shared.registry.redis_backend import RedisRegistry  # imports redis-py only when asked for

    return RedisRegistry(url, lease_s=lease_s)


_BACKENDS: dict[str, Callable[[str, float], PrefixRegistry]] = {"memory": _memory, "redis": _redis,
                                                                 "rediss": _redis}


def open_registry(url: str | None, *, lease_s: float = DEFAULT_LEASE_S) -> PrefixRegistry:
    """None, "" or "memory" -> an in-process `MemoryRegistry`; "redis://host:port/db" -> a `RedisRegistry`;
    "rediss://host:port/db?ssl_ca_certs=CA.pem" the same over TLS (redis-py's URL options, e.g. ssl_certfile and
    ssl_keyfile for a client certificate).

    Opening never connects: an unreachable Redis shows up later as `RegistryUnavailable`, which routing and publishing
    ride out. An unknown scheme raises ValueError.
    """
    if not url or url == "memory":
        return _memory("memory", lease_s)
    scheme = urlsplit(url).scheme
    backend = _BACKENDS.get(scheme)
    if backend is None:
        raise ValueError(f"unknown registry URL {redact_url(url)!r}: use 'memory', 'redis://host:port/db' "
                         "or 'rediss://host:port/db'")
    return backend(url, lease_s)


def redacted(url: str | None) -> str:
    """A registry URL fit for logs: its password (redis://:SECRET@host) replaced by ***."""
    if not url:
        return "none"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")).geturl()

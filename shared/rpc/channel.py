"""The one place gRPC channels and server credentials are made: TLS / mTLS from files, tracing, message sizes.

Client side: a channel is secure when a CA is given (`ClientTLS.ca`, used to verify the server), and presents a
client certificate when `cert` and `key` are given (mutual TLS). A service sets its client settings once at start-up
(`set_client_tls`); channels made without explicit settings use them. Server side: `ServerTLS` serves TLS with a
certificate and key; with a client CA it also requires every client to present a certificate signed by it (mTLS).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from shared import telemetry
from shared.rpc import internal_token

MAX_MESSAGE_BYTES = 256 * 2**20

Options = Sequence[tuple[str, int | str]]


def message_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def reconnect_options() -> list[tuple[str, int]]:
    """Every channel retries a peer that is not up yet (still loading its model) or restarting every 0.2-0.5 s, not
    with gRPC's default backoff (1 s growing 1.6x up to 120 s), which left a started stack unnoticed for up to
    10 s more (the launcher's health check, the router waiting for its targets); with a 2 s ceiling a stack that
    started in 4 s still waited 1.3 s more. A refused local connect costs next to nothing."""
    return [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 500)]


def _channel_options(options: Options) -> list[tuple[str, int | str]]:
    """The defaults (message sizes, reconnect backoff) under the caller's options (a key given wins)."""
    given = {k for k, _ in options}
    return [o for o in message_options() + reconnect_options() if o[0] not in given] + list(options)


def keepalive_options(time_ms: int = 20_000, timeout_ms: int = 10_000, idle: bool = True) -> list[tuple[str, int]]:
    """For channels that carry long-lived streams (draft -> target Verify, router -> draft): a peer that vanishes
    without closing its connection is noticed within time_ms + timeout_ms (~30 s) instead of never; the router's
    channels to targets use 5 + 4 s while calls are open (idle=False: no pings on an idle connection, which a
    server takes for abuse at that rate), so a frozen target's calls fail over within 10 s."""
    return [("grpc.keepalive_time_ms", time_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(idle)), ("grpc.http2.max_pings_without_data", 0)]


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror}") from None


@dataclass(slots=True, frozen=True)
class ClientTLS:
    """How this service calls others: `ca` verifies the servers (set = TLS); `cert` + `key` are the client
    certificate it presents (for servers that require one)."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs both its cert and key files")
        if self.cert and not self.ca:
            raise ValueError("a client certificate is only sent over TLS: give the CA that verifies the servers too")

    @property
    def secure(self) -> bool:
        return bool(self.ca)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA certificate"),
                                            private_key=_read(self.key, "client key"),
                                            certificate_chain=_read(self.cert, "client certificate"))


_client_tls = ClientTLS()


def set_client_tls(tls: ClientTLS) -> None:
    """This process's settings for the channels it makes (set once at service start)."""
    global _client_tls
    _client_tls = tls


def client_tls_from(cfg) -> ClientTLS:
    """From a service config's tls_ca / tls_client_cert / tls_client_key fields."""
    return ClientTLS(cfg.tls_ca, cfg.tls_client_cert, cfg.tls_client_key)


def server_tls_from(cfg) -> ServerTLS:
    """From a service config's tls_cert / tls_key / tls_client_ca fields."""
    return ServerTLS(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)


def aio_channel(address: str, tls: ClientTLS | None = None, options: Options = (),
                trace: bool = True) -> grpc.aio.Channel:
    """An asyncio channel; `trace` adds the client tracing interceptors (when tracing is on). Its calls carry the
    deployment's internal token when this process has one (shared.rpc.internal_token)."""
    opts = _channel_options(options)
    interceptors = internal_token.aio_client_interceptors() + (telemetry.aio_client_interceptors() if trace else [])
    creds = (tls or _client_tls).credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors or None)
    return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors or None)


def sync_channel(address: str, tls: ClientTLS | None = None, options: Options = (), trace: bool = True
                 ) -> grpc.Channel:
    """A blocking channel (the engine thread's calls); `trace` adds the client tracing interceptor; the internal
    token as for aio_channel."""
    opts = _channel_options(options)
    creds = (tls or _client_tls).credentials()
    channel = (grpc.insecure_channel(address, options=opts) if creds is None
               else grpc.secure_channel(address, creds, options=opts))
    channel = internal_token.sync_channel(channel)
    return telemetry.traced_sync_channel(channel) if trace else channel


@dataclass(slots=True, frozen=True)
class ServerTLS:
    """How a service listens: `cert` + `key` = TLS; `client_ca` set = clients must present a certificate it
    signed (mTLS), those without one are refused during the handshake."""
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both the server's cert and key files")
        if self.client_ca and not self.cert:
            raise ValueError("requiring client certificates (a client CA) needs TLS: give the server cert and key")

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.cert:
            return None
        key, cert = _read(self.key, "server key"), _read(self.cert, "server certificate")
        ca = _read(self.client_ca, "client CA certificate")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

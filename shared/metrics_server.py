"""The /metrics HTTP server of the target, draft and expert services, bounded: at most CONNECTIONS connections are
served at once (one thread each; more are closed at once), and a connection that sends no whole request within
TIMEOUT_S is closed. prometheus_client's own server starts a thread per connection and never times one out, so
idle sockets could hold a thread each for as long as they stay open."""
from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

CONNECTIONS = 8
TIMEOUT_S = 5.0


class _Quiet(WSGIRequestHandler):
    timeout = TIMEOUT_S                          # StreamRequestHandler: the socket's timeout while reading

    def log_message(self, format: str, *args) -> None:
        pass


class _Bounded(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args, **kw) -> None:
        self.slots = threading.BoundedSemaphore(CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)       # beyond the bound: closed, no thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def start(port: int, addr: str, registry: CollectorRegistry) -> _Bounded:
    """Serves `registry` on addr:port from a daemon thread; raises OSError when the port is taken."""
    server = make_server(addr, port, make_wsgi_app(registry), server_class=_Bounded, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server

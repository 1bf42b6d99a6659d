"""serve_metrics: a service exports the families it updates, not every family its imports define; the server is
bounded in threads and closes idle connections."""
from __future__ import annotations

import time
import urllib.request

from tests.conftest import free_port


def fetch(port: int) -> str:
    deadline = time.monotonic() + 10
    while True:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_prefixes_limit_the_export_and_none_exports_all():
    from services.draft import metrics as draft_metrics
    from shared import metrics  # noqa: F401  (defines the target's and router's families)
    from shared.metrics import serve_metrics

    draft_metrics.PROPOSED_TOKENS.inc(3)
    only, every = free_port(), free_port()
    serve_metrics(only, "127.0.0.1:1", ("upesi_draft_",))
    serve_metrics(every, "127.0.0.1:1")
    text = fetch(only)
    assert "upesi_draft_proposed_tokens_total" in text and "upesi_draft_sequences" in text
    assert "upesi_spec_draft_tokens" not in text and "upesi_requests_total" not in text
    assert "python_info" in text
    text = fetch(every)
    assert "upesi_draft_proposed_tokens_total" in text and "upesi_spec_draft_tokens_total" in text


def test_the_server_is_bounded_and_idle_connections_time_out(monkeypatch):
    import socket
    import threading

    from prometheus_client import CollectorRegistry, Gauge

    from shared import metrics_server
    monkeypatch.setattr(metrics_server._Quiet, "timeout", 0.5)
    registry = CollectorRegistry()
    Gauge("upesi_probe", "a gauge to read back", registry=registry).set(7)
    port = free_port()
    metrics_server.start(port, "127.0.0.1", registry)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]     # connect, send nothing
    time.sleep(0.2)
    assert threading.active_count() - before <= metrics_server.CONNECTIONS       # not a thread per socket
    for s in idle:                                      # all closed by the server: at once, or after the timeout
        s.settimeout(5)
        assert s.recv(1) == b""
        s.close()
    assert "upesi_probe 7.0" in fetch(port)

"""The router's HTTP server and idle or slow connections, on real sockets: 1,100 idle connections do not stop a
request, a connection that sends no request header is closed after the header deadline, and requests beyond the
limit get 503 at once."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from fastapi import FastAPI

from services.router.http import start_http
from shared.testing.stack import free_port


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    gate = threading.Event()
    entered: list[int] = []

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.get("/slow")
    async def slow() -> dict:
        entered.append(1)
        await asyncio.to_thread(gate.wait, 30)
        return {"slow": True}

    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        holder["server"], holder["task"] = loop.run_until_complete(start_http(app, "127.0.0.1", port, 4, 1.5))
        started.set()
        loop.run_until_complete(holder["task"])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    yield port, gate, entered
    gate.set()
    holder["server"].should_exit = True
    thread.join(30)


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_idle_connections_do_not_count(server):
    port, _, _ = server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1100)]
    try:
        assert get(port, "/ok") == (200, {"ok": True})
    finally:
        for s in idle:
            s.close()


def test_a_silent_connection_is_closed_after_the_header_deadline(server):
    port, _, _ = server
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")            # a header never finished
    s.settimeout(20)                                          # far past the 1.5 s deadline: a hang fails
    assert s.recv(100) == b""                                 # closed by the server
    s.close()


def test_requests_beyond_the_limit_get_503_at_once(server):
    port, gate, entered = server
    gate.clear()
    busy = [threading.Thread(target=get, args=(port, "/slow")) for _ in range(4)]
    for t in busy:
        t.start()
    deadline = time.monotonic() + 30
    while len(entered) < 4 and time.monotonic() < deadline:     # the four requests are being handled
        time.sleep(0.02)
    code, body = get(port, "/ok")
    assert code == 503 and body["error"]["type"] == "service_unavailable_error"
    gate.set()
    for t in busy:
        t.join(30)
    assert get(port, "/ok")[0] == 200

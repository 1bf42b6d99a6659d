"""A port another process holds stops the service that wanted it with one clear line, never a silent share: gRPC
servers bind without SO_REUSEPORT (shared.rpc.server), `upesi serve` checks every port it hands out before it
starts anything (services/launcher.py), and shared.rpc.ports.in_use tells a taken port from a free one."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared.rpc.ports import in_use
from shared.rpc.server import create_server
from shared.testing.stack import free_port, free_port_run

ROOT = Path(__file__).resolve().parents[2]


def _listener(port: int, reuse: bool = False) -> socket.socket:
    s = socket.socket()
    if reuse:                                               # as gRPC's listening sockets are
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_in_use_tells_a_listening_port_from_a_free_one() -> None:
    port = free_port()
    assert not in_use(f"127.0.0.1:{port}")
    with _listener(port):
        assert in_use(f"127.0.0.1:{port}")
        assert in_use(f"localhost:{port}")
    assert not in_use(f"127.0.0.1:{port}")
    srv = _listener(free_port(), reuse=True)
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    peer, _ = srv.accept()
    peer.close()                                            # the server's side closes first: its end waits (TIME_WAIT)
    client.close()
    srv.close()
    assert not in_use(f"127.0.0.1:{port}")                  # as a restarted service finds its port


def test_a_second_grpc_server_cannot_take_a_held_port() -> None:
    async def go() -> None:
        first = create_server()
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = create_server()
            with pytest.raises(RuntimeError):               # grpcio raises "Failed to bind"; shared it would return
                assert second.add_insecure_port(f"127.0.0.1:{port}") == 0
        finally:
            await first.stop(None)
    asyncio.run(go())


def _upesi(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_a_service_on_a_taken_port_exits_with_one_line() -> None:
    port = free_port()
    with _listener(port):
        out = _upesi("draft", "--address", f"127.0.0.1:{port}", "--proposer", "ngram", "--metrics-port", "0",
                     timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"upesi draft: cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("taken", [0, 1, 2])               # the first target, the second, the router
def test_serve_names_a_taken_port_before_it_starts_anything(taken: int) -> None:
    base = free_port_run(4)                                 # targets base, base + 1; router base + 2; HTTP base + 3
    with _listener(base + taken):
        out = _upesi("serve", "--target-address", f"127.0.0.1:{base}", "--target-replicas", "2",
                     "--address", f"127.0.0.1:{base + 2}", "--http-port", str(base + 3), timeout=60)
    name = ["target 0", "target 1", "router"][taken]
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"another process holds the port of {name} on 127.0.0.1:{base + taken}" in out.stderr
    assert "upesi: target" not in out.stdout                # nothing was started

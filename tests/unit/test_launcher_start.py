"""The launcher's start: a service killed by a signal while starting is started once more; an exit with a code,
or a second crash, stops the start with the service's command in the error."""
from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services import launcher
from shared.testing.stack import free_port


class Crashed:
    """A child that died of SIGABRT (or exited with `code`) before answering."""

    def __init__(self, args: list[str], code: int = -6) -> None:
        self.args = [sys.executable, "-m", "services.cli", *args]
        self.returncode, self.upesi_command = code, (args, None)

    def poll(self) -> int:
        return self.returncode


@pytest.fixture()
def healthy():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_crash_while_starting_is_started_once_more(monkeypatch, healthy):
    started = []

    def child(args, env=None):
        started.append(args)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(launcher, "_child", child)
    procs = [Crashed(["router", "--address", healthy])]
    try:
        launcher._wait_healthy(healthy, procs, timeout_s=20)
        assert started == [["router", "--address", healthy]] and isinstance(procs[0], subprocess.Popen)
    finally:
        for p in procs:
            if isinstance(p, subprocess.Popen):
                p.kill()
                p.wait()


def test_an_exit_code_or_a_second_crash_stops_the_start(monkeypatch, healthy):
    monkeypatch.setattr(launcher, "_child", lambda args, env=None: Crashed(args))
    with pytest.raises(RuntimeError, match="exited with code 2 while starting.*--bad"):
        launcher._wait_healthy(healthy, [Crashed(["router", "--bad"], code=2)], timeout_s=20)
    nobody = f"127.0.0.1:{free_port()}"                   # nothing answers there: the loop sees the second crash
    with pytest.raises(RuntimeError, match="code -6 while starting"):
        launcher._wait_healthy(nobody, [Crashed(["router"])], timeout_s=20)

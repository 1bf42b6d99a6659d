"""Helpers that tests and benchmarks share: free ports, and `upesi serve` started on them as a user runs it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]          # the repository

_GIVEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and never one this process gave out before: servers bind seconds later, and
    a port handed to two services fails the second one's start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def free_port_run(n: int) -> int:
    """A port p with p .. p + n - 1 all free (`upesi serve` puts the expert shards on the ports after the target's)."""
    while True:
        base, socks = free_port(), []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            _GIVEN.update(range(base, base + n))         # never handed out again, as free_port's
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


# The internal token of the stacks tests start (`upesi serve` keeps one it is given), for tests that call internal
# services directly or add a service to a running stack; `INTERNAL` is the metadata such calls carry.
INTERNAL_TOKEN = "upesi-tests-internal-token"
INTERNAL = [("x-upesi-internal-token", INTERNAL_TOKEN)]



def spawn(args: list[str], log) -> subprocess.Popen:
    """`python -m services.cli ARGS` from the checkout's root, its output into `log`."""
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)


def wait_healthy(address: str, timeout_s: float = 300, procs: list[subprocess.Popen] | None = None) -> None:
    """Until the gRPC health check at `address` answers SERVING (TimeoutError after timeout_s); AssertionError as
    soon as one of `procs` exits."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs or []), "a service exited while starting"
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(address)

def _ports_after_target(args: list[str]) -> int:
    """How many ports from --target-address on `upesi serve` with these flags takes (ServeConfig's addresses)."""
    def count(flag: str, default: int) -> int:
        return int(args[args.index(flag) + 1]) if flag in args[:-1] else default
    return count("--target-replicas", 1) + count("--expert-shards", 0) + count("--prefill-replicas", 0)


class Stack:
    """`upesi serve` on free ports, as a user runs it."""

    def __init__(self, tmp: Path, extra: list[str] | None = None, target_address: str | None = None) -> None:
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.log = tmp / "serve.log"
        if target_address is None:       # the replicas, expert shards and prefill targets take the ports after it
            target_address = f"127.0.0.1:{free_port_run(_ports_after_target(extra or []))}"
        cmd = [sys.executable, "-m", "services.cli", "serve", "--address", self.address,
               "--http-port", str(self.http_port), "--target-address", target_address,
               "--target-metrics-port", str(self.metrics_port), "--kv-cache-gb", "0.5",
               # a draft service on ports of its own: two stacks alive at once never share one
               "--draft-address", f"127.0.0.1:{free_port()}", "--draft-metrics-port", "0", *(extra or [])]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={"UPESI_INTERNAL_TOKEN": INTERNAL_TOKEN, **os.environ})

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"upesi serve exited early:\n{self.log.read_text()[-3000:]}")
            if "upesi: serving on" in self.log.read_text():
                return
            time.sleep(0.5)
        raise TimeoutError(self.log.read_text()[-3000:])

    def target_pids(self) -> dict[int, int]:
        """port -> pid of the stack's target processes (children of `upesi serve`, from /proc); a child that is
        gone or not reaped yet is left out."""
        import psutil
        out = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "target" in cmd and "--address" in cmd:
                out[int(cmd[cmd.index("--address") + 1].rsplit(":", 1)[1])] = child.pid
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

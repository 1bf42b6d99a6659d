"""A real `redis-server` for tests: a free port on 127.0.0.1, its own temp dir, no persistence, restartable in place.

Used by tests (the `redis_server` fixture of tests/integration/conftest.py) and bench/chaos.py:
    server = RedisServer(tmp_path).start()
    server.url          # "redis://127.0.0.1:<port>/0"
    server.stop()       # SIGTERM; the data is gone (--save "" --appendonly no)
    server.restart()    # a fresh, empty server on the same port
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from shared.testing.stack import free_port

READY_TIMEOUT_S = 10.0


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, binary: str = "redis-server",
                 password: str | None = None, users: Sequence[str] = (), tls: dict[str, Path] | None = None) -> None:
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(f"{binary} not found on PATH; install Redis (e.g. apt-get install redis-server)")
        self.binary, self.workdir = path, Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._picked_port = port is None
        self.password = password               # requirepass, from a config file (not on the command line)
        self.users = tuple(users)              # ACL users, each a config file `user` line's rules
        self.tls = tls                         # {"ca", "cert", "key"} PEM files: TLS only, no plaintext port

    @property
    def url(self) -> str:
        """The URL clients use; with TLS, rediss:// verifying the server against the test CA."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca']}&ssl_cert_reqs=required"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server and wait for PING; with a picked port, retry on a new one if another process took it."""
        attempts = 3 if self._picked_port else 1
        for attempt in range(attempts):
            if self.port is None:
                self.port = free_port()
            try:
                self._spawn()
                return self
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.port = None
        return self

    def _spawn(self) -> None:
        log = self.workdir / "redis.log"
        conf = self.workdir / "redis.conf"
        tls = (f"tls-cert-file {self.tls['cert']}\ntls-key-file {self.tls['key']}\n"
               f"tls-ca-cert-file {self.tls['ca']}\ntls-auth-clients no\n") if self.tls else ""
        conf.write_text((f"requirepass {self.password}\n" if self.password else "")
                        + "".join(f"user {u}\n" for u in self.users) + tls)
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        args = [
            self.binary,
            str(conf),
            *ports,
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(log),
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:  # exited: most often the port is taken
                self._proc = None
                raise RuntimeError(f"redis-server on port {self.port} exited; see {log}")
            if self._ping():
                return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {READY_TIMEOUT_S}s; see {log}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as raw:
                s = raw
                if self.tls:
                    s = ssl.create_default_context(cafile=str(self.tls["ca"])).wrap_socket(raw,
                                                                                         server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH") or reply.startswith(b"-NOPERM")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and wait until it has exited."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would end it, and wait until it has exited."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        proc.kill()
        proc.wait()

    def restart(self) -> RedisServer:
        """Stop, then start an empty server on the same port."""
        self.stop()
        self._spawn()
        return self

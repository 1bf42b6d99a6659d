"""No secret on a command line, in --help or in an error: a running stack given an API key, a cache secret and
password-protected Redis URLs (registry and KV block store), its processes' /proc/PID/cmdline read."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from shared.testing.redis_server import RedisServer
from tests.conftest import ROOT, Stack

pytestmark = pytest.mark.slow
SECRETS = {"UPESI_API_KEY": "key-f00d-4a11", "UPESI_CACHE_SECRET": "salt-beef-77"}


def test_a_running_stack_shows_no_secret(tmp_path, monkeypatch):
    redis = RedisServer(tmp_path / "redis", password="pw-c0ffee-99").start()
    try:
        for name, value in {**SECRETS, "UPESI_REGISTRY": redis.url, "UPESI_KV_STORE": redis.url}.items():
            monkeypatch.setenv(name, value)                  # as a user gives secrets to `upesi serve`
        stack = Stack(tmp_path)
        try:
            stack.wait_ready()
            procs = [psutil.Process(stack.proc.pid), *psutil.Process(stack.proc.pid).children(recursive=True)]
            lines = [" ".join(p.cmdline()) for p in procs]
            assert any(" target " in f" {line} " for line in lines) and any("router" in line for line in lines)
            for line in lines:
                assert "pw-c0ffee-99" not in line and not any(v in line for v in SECRETS.values()), line
            env = psutil.Process(next(p.pid for p in procs if "router" in p.cmdline())).environ()
            assert env.get("UPESI_REGISTRY") == redis.url             # handed down in the environment instead
            target = next(p for p in procs if " target " in f" {' '.join(p.cmdline())} ")
            store_key = target.environ().get("UPESI_KV_STORE_KEY", "")   # made by `upesi serve` for its targets
            assert len(store_key) == 64 and not any(store_key in line for line in lines)
        finally:
            assert stack.stop() == 0, stack.log.read_text()[-3000:]
        assert "pw-c0ffee-99" not in stack.log.read_text()
    finally:
        redis.stop()


@pytest.mark.parametrize("command", ["serve", "router", "target"])
def test_help_and_errors_show_no_secret(command):
    env = {**os.environ, **SECRETS, "UPESI_KV_STORE": "redis://:pw-c0ffee-99@127.0.0.1:1/0",
           "UPESI_REGISTRY": "redis://:pw-c0ffee-99@127.0.0.1:1/0"}
    out = subprocess.run([sys.executable, "-m", "services.cli", command, "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "default: set" in out.stdout
    assert not any(s in out.stdout for s in (*SECRETS.values(), "pw-c0ffee-99"))
    bad = subprocess.run([sys.executable, "-m", "services.cli", "target", "--kv-store", "http://:pw-c0ffee-99@h/0"],
                         cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "kv_store" in bad.stderr and "pw-c0ffee-99" not in bad.stderr

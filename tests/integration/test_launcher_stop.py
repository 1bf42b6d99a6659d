"""`upesi serve` never leaves a service behind: a second Ctrl-C while it stops does not interrupt the stop, and a
launcher killed with SIGKILL takes its children with it (Linux: PR_SET_PDEATHSIG)."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Stack

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, PR_SET_PDEATHSIG")]


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float = 90) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def stop_all(stack: Stack, kids: list[int]) -> None:
    """What a failed test leaves: the launcher, then any child still there (only the ones this test started)."""
    if stack.proc.poll() is None:
        stack.proc.kill()
        stack.proc.wait()
    for pid in kids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigkill_of_the_launcher_stops_every_service(tmp_path):
    stack, kids = Stack(tmp_path), []
    try:
        stack.wait_ready()
        kids = children(stack.proc.pid)
        assert len(kids) == 2                                         # target and router
        os.kill(stack.proc.pid, signal.SIGKILL)
        stack.proc.wait(timeout=30)
        assert wait_gone(kids) == []
    finally:
        stop_all(stack, kids)


def test_a_second_interrupt_does_not_cut_the_stop_short(tmp_path):
    stack, kids = Stack(tmp_path), []
    try:
        stack.wait_ready()
        kids = children(stack.proc.pid)
        stack.proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        stack.proc.send_signal(signal.SIGINT)
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(timeout=90) == 0, stack.log.read_text()[-2000:]
        assert wait_gone(kids) == []
    finally:
        stop_all(stack, kids)

"""`--disable-kernels` (shared/ops/switches.py): one option for every C kernel's off switch. Each name is a switch a
kernel really reads, unknown names are refused with the known ones, and a kernel turned off stays off in the process
(a fresh interpreter: kernels read their switch once, at first use)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.ops import qgemm, switches

OPS = Path(switches.__file__).parent


def test_every_name_is_a_switch_a_kernel_reads():
    sources = "".join(p.read_text() for p in OPS.glob("*.py") if p.name != "switches.py")
    read = set(re.findall(r'"(UPESI_[A-Z0-9_]+)"', sources)) - {"UPESI_KERNEL_CACHE"}
    assert {switches.env_name(k) for k in switches.KERNELS} == read


def test_unknown_names_are_refused_with_the_known_ones(monkeypatch):
    with pytest.raises(ValueError, match="known: rows_gemm, amx"):
        switches.parse("qgemm, warp_drive")
    monkeypatch.setenv("UPESI_QGEMM", "1")             # recorded, so the test leaves the environment as it was
    monkeypatch.setenv("UPESI_AMX", "1")
    assert switches.disable(" qgemm,amx ") == ["qgemm", "amx"]
    import os
    assert os.environ["UPESI_QGEMM"] == os.environ["UPESI_AMX"] == "0"
    assert switches.disable(None) == []


@pytest.mark.skipif(not qgemm.available(), reason="the quantised kernel does not run here")
def test_a_disabled_kernel_is_not_used():
    code = ("import sys; from shared.ops import switches, qgemm; switches.disable(sys.argv[1]); "
            "print(qgemm.available())")
    run = [subprocess.run([sys.executable, "-c", code, names], capture_output=True, text=True, check=True).stdout
           for names in ("", "qgemm")]
    assert run == ["True\n", "False\n"]

"""What this CPU can do, from /proc/cpuinfo: the kernels and the engine's dtype default read it."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (the avx512_bf16 or amx_bf16 flag)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})

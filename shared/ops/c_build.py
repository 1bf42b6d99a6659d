"""Compiles a C kernel of shared/ops once per machine and loads it with ctypes (rows_gemm.c, rows_gemm_bf16.c,
rows_gemm_amx.c, cpu_attention.c, rms_norm.c, decoder_bf16.c, argmax.c).

The shared object goes to ~/.cache/upesi/kernels (or $UPESI_KERNEL_CACHE), named by the hash of the source, the
headers beside it and the flags, with an atomic rename, so concurrent processes may race; `-fopenmp` links the
OpenMP runtime torch has already loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.cache_dir import cache_dir

log = logging.getLogger(__name__)


def build(source: Path, flags: list[str]) -> Path:
    """source.c -> the path of its compiled .so (compiled now only where no build of this source and flags exists).
    Raises OSError (no compiler) or subprocess.CalledProcessError (the compiler failed)."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir("kernels", "UPESI_KERNEL_CACHE") / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(source)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path, flags: list[str]) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source, flags)))


def load_or_none(source: Path, flags: list[str], switch: str, what: str) -> ctypes.CDLL | None:
    """The kernel's library, or None (logged once) where the variable `switch` is 0 / false / no, the CPU has
    neither AVX2 nor AVX-512, or the build fails: the caller then keeps its torch path."""
    if os.environ.get(switch, "1") in ("0", "false", "no"):
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):       # both imply FMA
        return None
    try:
        return load(source, flags)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning("%s unavailable, using torch: %s %s", what, e, err.decode(errors="replace")[-500:])
        return None

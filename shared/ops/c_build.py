"""Compiles a C kernel of shared/ops once per machine and loads it with ctypes (rows_gemm.c, cpu_attention.c).

The shared object goes to ~/.cache/upesi/kernels (or $UPESI_KERNEL_CACHE), named by the source's and the flags'
hash, with an atomic rename, so concurrent processes may race; `-fopenmp` links the OpenMP runtime torch has
already loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.cache_dir import cache_dir


def build(source: Path, flags: list[str]) -> Path:
    """source.c -> the path of its compiled .so (compiled now only where no build of this source and flags exists).
    Raises OSError (no compiler) or subprocess.CalledProcessError (the compiler failed)."""
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
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

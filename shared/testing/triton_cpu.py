"""Triton kernels on CPU for tests: the kernel modules loaded with TRITON_INTERPRET=1, for the tests that ask.

`@triton.jit` decides when a kernel is defined whether it is compiled (CUDA) or interpreted (CPU), and the kernel
modules read the variable again when called. `interpreted` sets it, loads the modules again so that their kernels
are interpreted ones, and on leaving restores the variable and loads them as a process without it would: nothing
outside the caller's tests sees the change.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

VARIABLE = "TRITON_INTERPRET"


@contextmanager
def interpreted(*modules: str) -> Iterator[list[ModuleType]]:
    """The kernel modules `modules` (dotted names) loaded under the interpreter, for the duration of the block."""
    before = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = "1"
    try:
        yield [importlib.reload(importlib.import_module(m)) for m in modules]
    finally:
        if before is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = before
        for m in modules:
            if m in sys.modules:
                importlib.reload(sys.modules[m])

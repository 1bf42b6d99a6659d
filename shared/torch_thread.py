"""One thread for the torch work of a service process.

libgomp (the OpenMP runtime of torch's CPU builds) gives every thread that opens a parallel region its own team of
worker threads, and once a process holds more OpenMP threads than there are cores, the workers stop spinning between
regions and sleep instead; a decode step then waits for them to wake up dozens of times (a step on a second thread
took about twice as long: docs/performance.md). So a service builds its model and runs every step on one thread: the
engine's own thread in the target (shared.engine.async_engine), this module's in the draft service and the expert
shards.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_POOL = ThreadPoolExecutor(1, thread_name_prefix="torch")


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on the torch thread, waiting for it (start-up: building a model)."""
    return _POOL.submit(fn, *args, **kwargs).result()


async def run(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on the torch thread without blocking the event loop; calls run one at a time, in order."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))

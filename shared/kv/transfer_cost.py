"""Read a stored block or compute it again? Both costs measured, the cheaper one taken.

    read(n blocks)    = latency + n * block_bytes * seconds_per_byte     (measured on each remote read)
    compute(n blocks) = n * block_size * seconds_per_token               (measured on each prefill step)

Before both are measured the store is read (a CPU prefill is slow; a GPU one soon shows itself cheaper).
"""
from __future__ import annotations

ALPHA = 0.2                 # weight of a new measurement in the moving averages
MIN_PREFILL_TOKENS = 32     # steps of fewer tokens are decodes: their time per token says nothing of a prefill


class _Ewma:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x


class TransferCost:
    def __init__(self, block_bytes: int, block_size: int) -> None:
        self.block_bytes, self.block_size = block_bytes, block_size
        self._latency = _Ewma()               # seconds of one read call, beyond its bytes
        self._per_byte = _Ewma()
        self._per_token = _Ewma()

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0:
            self._per_byte.add(seconds / num_bytes)
        else:
            self._latency.add(seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self._per_token.add(seconds / num_tokens)

    def read_seconds(self, num_blocks: int) -> float | None:
        if self._per_byte.value is None:
            return None
        return (self._latency.value or 0.0) + num_blocks * self.block_bytes * self._per_byte.value

    def compute_seconds(self, num_blocks: int) -> float | None:
        if self._per_token.value is None:
            return None
        return num_blocks * self.block_size * self._per_token.value

    def worth_reading(self, num_blocks: int) -> bool:
        read, compute = self.read_seconds(num_blocks), self.compute_seconds(num_blocks)
        return read is None or compute is None or read < compute

"""The draft service's settings."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import option


@dataclass(slots=True)
class DraftConfig:
    address: str = option("127.0.0.1:50071", "gRPC listen address")
    proposer: str = option("ngram", "ngram, or draft-model:PATH (a small Llama-family model sharing the tokenizer)")
    block_size: int = option(16, "tokens per KV block of the draft model")
    kv_blocks: int = option(2048, "KV blocks of the draft model")
    max_model_len: int = option(8192, "longest sequence the draft model handles")
    device: str = option("auto", "cpu, cuda or auto")
    num_threads: int | None = option(None, "torch CPU threads")

    def __post_init__(self) -> None:
        if self.kv_blocks < 1 or self.block_size < 1:
            raise ValueError("kv_blocks and block_size must be positive")

"""The router's settings."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import option


@dataclass(slots=True)
class RouterConfig:
    address: str = option("127.0.0.1:50051", "public gRPC listen address")
    http_host: str = option("127.0.0.1", "HTTP host for /health and /metrics")
    http_port: int = option(8000, "HTTP port (0 = off)")
    target: str = option("127.0.0.1:50061", "target replica addresses, comma-separated")
    registry: str | None = option(None, "prefix-block registry to route by: redis://host:port/db (default: load only)")
    model: str | None = option(None, "model whose tokenizer and chat template to use (default: SmolLM2-135M-Instruct)")
    max_concurrent_requests: int = option(256, "requests served at once; more get RESOURCE_EXHAUSTED")
    max_n: int = option(16, "largest n (choices per request)")
    max_stop_strings: int = option(16, "most stop strings per request")
    target_wait_s: float = option(600.0, "how long to wait for the target at start-up")

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1 or self.max_n < 1:
            raise ValueError("max_concurrent_requests and max_n must be positive")

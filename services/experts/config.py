"""The expert-shard service's settings."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services import options
from shared.config import option
from shared.engine.config import check_dtype, parse_hf_overrides, resolve_device, resolve_dtype, serving_dtype


@dataclass(slots=True)
class ExpertsConfig(options.ServerTLS):
    address: str = option("127.0.0.1:50071", "gRPC listen address")
    metrics_port: int = option(0, "Prometheus /metrics port (0 = off)")
    model: str | None = options.model()
    hf_overrides: str | None = options.hf_overrides()
    shard_index: int = option(0, "this shard's index, 0 .. num_shards - 1 (its place in the target's --expert-shards)")
    num_shards: int = option(1, "number of expert shards")
    expert_placement: str | None = options.expert_placement()
    device: str = option("auto", "cpu, cuda, or auto")
    dtype: str = options.dtype()
    num_threads: int | None = option(None, "torch CPU threads (default: torch's choice)")
    progress: bool = option(False, "show a progress bar while reading the checkpoint")
    nvfp4_act_quant: bool = options.nvfp4_act_quant()
    int8_activations: bool = options.int8_activations()
    disable_kernels: str | None = options.disable_kernels()

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, {self.num_shards}), got {self.shard_index}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port out of range: {self.metrics_port}")
        check_dtype(self.dtype)
        parse_hf_overrides(self.hf_overrides)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(serving_dtype(self.dtype, self.torch_device()), self.torch_device())

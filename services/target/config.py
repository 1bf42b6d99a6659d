"""The target service's settings."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import option
from shared.engine.config import (
    DTYPE_HELP,
    EngineConfig,
    check_draft_confidence,
    check_dtype,
    check_speculative_max_seqs,
    check_tree_shape,
    check_wide_threads,
    resolve_device,
    serving_dtype,
)


@dataclass(slots=True)
class TargetConfig:
    address: str = option("127.0.0.1:50061", "gRPC listen address")
    metrics_port: int = option(8061, "Prometheus /metrics port (0 = off)")
    model: str | None = option(None, "model: a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    device: str = option("auto", "cpu, cuda, or auto")
    dtype: str = option("auto", DTYPE_HELP)
    block_size: int = option(16, "tokens per KV block")
    kv_cache_gb: float = option(1.0, "memory for the KV cache in GiB")
    num_kv_blocks: int | None = option(None, "number of KV blocks (overrides --kv-cache-gb)")
    max_num_seqs: int = option(64, "most sequences in the running batch")
    max_num_batched_tokens: int = option(512, "most tokens per forward step (chunked-prefill budget)")
    max_model_len: int | None = option(None, "context window in tokens (default: the model's)")
    num_threads: int | None = option(None, "torch CPU threads (default: torch's choice)")
    wide_threads: int | None = option(None, "torch CPU threads of forward steps over 4 or more rows (a draft "
                                            "verification's K + 1 rows, prefill, big batches): those are "
                                            "compute-bound on CPU, where a decode step's few rows are memory-bound "
                                            "(default: --num-threads)")
    progress: bool = option(True, "show a progress bar while loading")
    enable_prefix_caching: bool = option(True, "reuse computed KV blocks across requests with a common prefix")
    speculative: str | None = option(None, "speculative proposer: ngram or draft-model:PATH (default: none)")
    num_speculative_tokens: int = option(3, "default K, the draft tokens verified per step")
    adaptive_speculation: bool = option(True, "each request's K follows its acceptance (one more after all drafts "
                                              "were accepted, one fewer after none, between 1 and K); false: "
                                              "always K")
    speculative_max_seqs: int = option(0, "speculate only while at most this many sequences are running; with "
                                          "more, every sequence decodes plainly until the batch shrinks (a big "
                                          "batch already fills the matmuls that drafts would; 0 = always)")
    draft_confidence: float | None = option(None, "eagle heads: stop drafting a sequence once the head's "
                                                  "probability of its draft path falls below this (0 = always K "
                                                  "drafts; default: the head's own, from eagle.json)")
    draft_tree_nodes: int | None = option(None, "eagle heads: greedy requests draft trees (several candidates "
                                                "per depth, up to K depths, verified in one pass) of this many "
                                                "nodes per step, shared by the step's greedy sequences; 0 = chains "
                                                "of K (default: the head's own, from eagle.json)")
    nvfp4_act_quant: bool = option(False, "NVFP4 checkpoints: emulate W4A4 (quantise activations per block of 16)")
    draft_timeout_s: float = option(5.0, "how long an engine step waits for a draft service's proposals on its "
                                         "Verify stream; past it those requests decode without drafts for 5 s")
    registry: str | None = option(None, "prefix-block registry to publish to: redis://host:port/db (default: none)")
    replica_id: str | None = option(None, "this replica's name in the registry (default: its address)")
    expert_shards: str | None = option(None, "expert shard addresses, comma-separated in shard order: every layer's "
                                             "FFN runs there (default: none, FFNs run in this process)")
    expert_placement: str | None = option(None, "placement JSON of FFN units on the expert shards "
                                                "(default: contiguous)")
    expert_timeout_s: float = option(5.0, "deadline of one call to an expert shard; past it the shard counts as down")
    tls_cert: str | None = option(None, "TLS: this server's certificate (PEM); with tls_key the port serves TLS")
    tls_key: str | None = option(None, "TLS: this server's private key (PEM)")
    tls_client_ca: str | None = option(None, "mTLS: CA (PEM) that client certificates must be signed by; set = "
                                             "clients without one are refused")
    tls_ca: str | None = option(None, "TLS to the services this one calls: CA (PEM) that verifies them "
                                      "(set = calls use TLS)")
    tls_client_cert: str | None = option(None, "mTLS: the client certificate (PEM) presented to them")
    tls_client_key: str | None = option(None, "mTLS: the client certificate's private key (PEM)")
    rebalance_interval_s: float = option(0.0, "expert shards: check the measured expert load every this many seconds "
                                              "and replicate hot experts when shards are out of balance (0 = off)")
    rebalance_threshold: float = option(1.25, "rebalance when an MoE layer's busiest shard carries more than this "
                                              "times the mean shard load")
    rebalance_extra: int = option(2, "replicas the rebalancer adds per unbalanced layer per round")

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_draft_confidence(self.draft_confidence)
        check_tree_shape(self.draft_tree_nodes)
        check_speculative_max_seqs(self.speculative_max_seqs)
        check_wide_threads(self.wide_threads)
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port out of range: {self.metrics_port}")
        if self.draft_timeout_s <= 0:
            raise ValueError(f"draft_timeout_s must be positive, got {self.draft_timeout_s}")
        if self.expert_timeout_s <= 0:
            raise ValueError(f"expert_timeout_s must be positive, got {self.expert_timeout_s}")
        if self.rebalance_interval_s < 0 or self.rebalance_threshold < 1 or self.rebalance_extra < 1:
            raise ValueError("rebalance_interval_s must be >= 0, rebalance_threshold >= 1 and rebalance_extra >= 1")
        if self.expert_shards is not None and not self.expert_addresses():
            raise ValueError("expert_shards is set but names no address")

    def expert_addresses(self) -> list[str]:
        return [a.strip() for a in (self.expert_shards or "").split(",") if a.strip()]

    def engine_config(self) -> EngineConfig:
        dtype = serving_dtype(self.dtype, resolve_device(self.device))
        return EngineConfig(model=self.model, device=self.device, dtype=dtype, block_size=self.block_size,
                            kv_cache_gb=self.kv_cache_gb, num_kv_blocks=self.num_kv_blocks,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len, num_threads=self.num_threads,
                            wide_threads=self.wide_threads, progress=self.progress,
                            enable_prefix_caching=self.enable_prefix_caching, speculative=self.speculative,
                            num_speculative_tokens=self.num_speculative_tokens,
                            adaptive_speculation=self.adaptive_speculation,
                            speculative_max_seqs=self.speculative_max_seqs,
                            draft_confidence=self.draft_confidence, draft_tree_nodes=self.draft_tree_nodes,
                            nvfp4_act_quant=self.nvfp4_act_quant)

"""The target service's settings."""
from __future__ import annotations

from dataclasses import dataclass, fields

from services import options
from shared.config import option
from shared.engine.config import (
    EngineConfig,
    check_draft_confidence,
    check_dtype,
    check_kv_store,
    check_lookup_tokens,
    check_speculative_max_seqs,
    check_tree_ngram,
    check_tree_shape,
    check_wide_threads,
    check_write_policy,
    parse_hf_overrides,
    resolve_device,
    serving_dtype,
)


@dataclass(slots=True)
class TargetConfig(options.TLS):
    address: str = option("127.0.0.1:50061", "gRPC listen address")
    metrics_port: int = option(8061, "Prometheus /metrics port (0 = off)")
    model: str | None = options.model()
    hf_overrides: str | None = options.hf_overrides()
    device: str = option("auto", "cpu, cuda, or auto")
    dtype: str = options.dtype()
    block_size: int = option(16, "tokens per KV block")
    kv_cache_gb: float = option(1.0, "memory for the KV cache in GiB")
    num_kv_blocks: int | None = option(None, "number of KV blocks (overrides --kv-cache-gb)")
    max_num_seqs: int = option(64, "most sequences in the running batch")
    max_num_batched_tokens: int = option(512, "most tokens per forward step (chunked-prefill budget)")
    prefill_chunk_tokens: int = option(2048, "most tokens per forward step while no sequence is decoding: a "
                                             "prompt alone prefills in chunks this long")
    prefill_itl_stretch: float = options.prefill_itl_stretch()
    max_waiting_seqs: int = option(1024, "most sequences waiting for a place in the batch; a request beyond it is "
                                         "refused with RESOURCE_EXHAUSTED (the router tries it again elsewhere or "
                                         "answers 429) instead of queueing without bound")
    max_model_len: int | None = option(None, "context window in tokens (default: the model's)")
    num_threads: int | None = option(None, "torch CPU threads (default: torch's choice)")
    wide_threads: int | None = option(None, "torch CPU threads of forward steps over 4 or more rows (a draft "
                                            "verification's K + 1 rows, prefill, big batches): those are "
                                            "compute-bound on CPU, where a decode step's few rows are memory-bound "
                                            "(default: --num-threads)")
    progress: bool = option(True, "show a progress bar while loading")
    enable_prefix_caching: bool = option(True, "reuse computed KV blocks across requests with a common prefix")
    kv_store: str | None = options.kv_store()
    kv_store_key: str | None = options.kv_store_key()
    kv_store_gb: float = options.kv_store_gb()
    kv_store_ttl_s: float = options.kv_store_ttl_s()
    kv_store_sync: bool = options.kv_store_sync()
    kv_store_write_policy: str = options.kv_store_write_policy()
    kv_store_write_threshold: int = options.kv_store_write_threshold()
    kv_host_gb: float = options.kv_host_gb()
    kv_disk_dir: str | None = options.kv_disk_dir()
    kv_disk_gb: float = options.kv_disk_gb()
    stream_interval: int = options.stream_interval()
    speculative: str | None = option(None, "speculative proposer: ngram or draft-model:PATH (default: none)")
    num_speculative_tokens: int = options.num_speculative_tokens()
    num_lookup_tokens: int = options.num_lookup_tokens()
    adaptive_speculation: bool = options.adaptive_speculation()
    speculation_guard: bool = options.speculation_guard()
    lookup_speculation: bool = options.lookup_speculation()
    speculative_max_seqs: int = options.speculative_max_seqs(0)
    draft_confidence: float | None = options.draft_confidence()
    draft_tree_nodes: int | None = options.draft_tree_nodes()
    draft_tree_ngram: int | None = options.draft_tree_ngram()
    nvfp4_act_quant: bool = options.nvfp4_act_quant()
    dequantise_gguf: bool = options.dequantise_gguf()
    int8_activations: bool = options.int8_activations()
    disable_kernels: str | None = options.disable_kernels()
    capture_hidden: bool = option(False, "keep every position's last hidden state beside its KV from the start "
                                         "(about 5% more memory than the KV cache), so that a prefix cached before "
                                         "an EAGLE draft service first connects still gives its head the prompt's "
                                         "features (otherwise kept from that moment on). `upesi serve --draft "
                                         "eagle:DIR` turns it on")
    draft_timeout_s: float = option(5.0, "the longest an engine step waits for a draft service's proposals on its "
                                         "Verify stream (a draft's first proposals may take seconds to warm up); "
                                         "once its answers are measured, a step waits 10x their usual time (at "
                                         "least 0.2 s). Past it those requests decode without drafts, and no step "
                                         "waits, until the draft answers")
    registry: str | None = option(None, "prefix-block registry to publish to: redis://host:port/db (rediss:// for "
                                         "TLS; default: none)")
    replica_id: str | None = option(None, "this replica's name in the registry (default: its address)")
    expert_shards: str | None = option(None, "expert shard addresses, comma-separated in shard order: every layer's "
                                             "FFN runs there (default: none, FFNs run in this process)")
    expert_placement: str | None = options.expert_placement()
    expert_timeout_s: float = option(5.0, "deadline of one call to an expert shard; past it the shard counts as down")
    rebalance_interval_s: float = option(0.0, "expert shards: check the measured expert load every this many seconds "
                                              "and replicate hot experts when shards are out of balance (0 = off)")
    rebalance_threshold: float = option(1.25, "rebalance when an MoE layer's busiest shard carries more than this "
                                              "times the mean shard load")
    rebalance_extra: int = option(2, "replicas the rebalancer adds per unbalanced layer per round")

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        parse_hf_overrides(self.hf_overrides)
        check_draft_confidence(self.draft_confidence)
        check_tree_shape(self.draft_tree_nodes)
        check_tree_ngram(self.draft_tree_ngram)
        check_lookup_tokens(self.num_lookup_tokens)
        check_speculative_max_seqs(self.speculative_max_seqs)
        check_wide_threads(self.wide_threads)
        check_kv_store(self.kv_store, self.kv_store_gb, self.kv_store_ttl_s, self.kv_host_gb, self.kv_disk_gb)
        check_write_policy(self.kv_store_write_policy, self.kv_store_sync, self.kv_store_write_threshold)
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port out of range: {self.metrics_port}")
        if self.stream_interval < 0:
            raise ValueError(f"stream_interval must be >= 0, got {self.stream_interval}")
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
        """The engine's settings: every EngineConfig field this config has, with "auto" dtype resolved here."""
        own = {f.name: getattr(self, f.name) for f in fields(EngineConfig) if hasattr(self, f.name)}
        return EngineConfig(**own | {"dtype": serving_dtype(self.dtype, resolve_device(self.device)),
                                     "hf_overrides": parse_hf_overrides(self.hf_overrides)})

"""The settings of `upesi serve`: one dataclass of every flag, checked on its own (no torch), and what each
service's share of them is (the addresses of targets, shards and prefill targets, a target's KV store flags)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from services import options
from shared.config import option
from shared.engine.config import (
    check_draft_confidence,
    check_dtype,
    check_speculative_max_seqs,
    check_kv_store,
    check_lookup_tokens,
    check_tree_ngram,
    check_tree_shape,
    check_wide_threads,
    check_write_policy,
    parse_hf_overrides,
)

DIRECT_HOST_GB = 1.0          # a decode target's host tier for P/D with direct transfer, unless --kv-host-gb is set

@dataclass(slots=True)
class ServeConfig:
    model: str | None = options.model()
    hf_overrides: str | None = options.hf_overrides()
    chat_template: str | None = option(None, "router: a Jinja chat template file used instead of the model's own")
    reasoning_parser: str = option("", "router: think = a chat answer's <think>...</think> becomes reasoning_content")
    tool_call_parser: str = options.tool_call_parser()
    anonymous_cached_tokens: bool = options.anonymous_cached_tokens()
    anonymous_prefix_cache: str = options.anonymous_prefix_cache()
    served_model_name: str | None = option(None, "the model's name in the OpenAI API (default: the model's file or "
                                                 "folder name without extension or quantisation suffix)")
    address: str = option("127.0.0.1:50051", "router gRPC address (the public API)")
    http_host: str = option("127.0.0.1", "router HTTP host")
    http_port: int = option(8000, "router HTTP port (/health, /metrics)")
    target_address: str = option("127.0.0.1:50061", "first target's gRPC address (replica i listens on port + i)")
    target_metrics_port: int = option(8061, "first target's /metrics port, + i for replica i (0 = off)")
    target_replicas: int = option(1, "number of target replicas")
    registry: str | None = option(None, "prefix-block registry shared by router and targets: redis://host:port/db "
                                         "(rediss://host:port/db?ssl_ca_certs=CA.pem for TLS)")
    kv_cache_gb: float = option(1.0, "target KV cache size in GiB")
    kv_store: str | None = options.kv_store()
    kv_store_key: str | None = options.kv_store_key()
    kv_store_gb: float = options.kv_store_gb()
    kv_store_ttl_s: float = options.kv_store_ttl_s()
    kv_host_gb: float = options.kv_host_gb()
    kv_disk_dir: str | None = option(None, "local-disk tier of the KV block store: a directory; target replica i "
                                           "writes its blocks under DIR/target-i (default: none)")
    kv_disk_gb: float = options.kv_disk_gb()
    kv_store_write_policy: str = options.kv_store_write_policy()
    kv_store_write_threshold: int = options.kv_store_write_threshold()
    prefill_replicas: int = option(0, "prefill-only targets (prefill/decode disaggregation): the router has each "
                                      "prompt computed on one of them, which hands its KV blocks to the decode "
                                      "target (--kv-transfer). They listen on the ports after the expert shards'")
    kv_transfer: str = options.kv_transfer()
    max_num_seqs: int = option(64, "target: most sequences in the running batch")
    num_threads: int | None = option(None, "target: torch CPU threads")
    wide_threads: int | None = option(None, "target: torch CPU threads of forward steps over 4 or more rows "
                                            "(verification, prefill, big batches; default: --num-threads)")
    draft_num_threads: int = option(2, "draft service: torch CPU threads. Its OpenMP workers spin only briefly "
                                       "after each parallel region (GOMP_SPINCOUNT, default 20000) and then sleep, "
                                       "so they leave the cores to the target's verification that follows")
    device: str = option("auto", "target device: cpu, cuda or auto")
    dtype: str = options.dtype("weights and activations of the targets, draft and expert shards: "
                               + options.DTYPE_HELP)
    expert_shards: int = option(0, "expert shard processes (0 = FFNs run in the target); they listen on the ports "
                                   "after the targets'")
    expert_placement: str | None = options.expert_placement()
    speculative: str | None = option(None, "speculative proposer inside each target: ngram, draft-model:PATH or "
                                           "eagle:PATH")
    draft: str | None = option(None, "start a draft service with this proposer (ngram, draft-model:PATH or "
                                     "eagle:PATH): the router sends speculative requests to it, and it drives "
                                     "a Verify stream to the chosen target")
    num_speculative_tokens: int = options.num_speculative_tokens()
    num_lookup_tokens: int = options.num_lookup_tokens()
    adaptive_speculation: bool = options.adaptive_speculation()
    speculation_guard: bool = options.speculation_guard()
    lookup_speculation: bool = options.lookup_speculation()
    prefill_itl_stretch: float = options.prefill_itl_stretch()
    speculative_max_requests: int = option(1, "with --draft: requests speculate only while at most this many are "
                                              "in flight at the router (more: plain decoding on the target; "
                                              "0 = always)")
    speculative_max_seqs: int = options.speculative_max_seqs(1)
    stream_interval: int = options.stream_interval()
    draft_confidence: float | None = options.draft_confidence()
    draft_tree_nodes: int | None = options.draft_tree_nodes()
    draft_tree_ngram: int | None = options.draft_tree_ngram()
    draft_address: str = option("127.0.0.1:50071", "draft service address (with --draft)")
    ready_timeout_s: float = option(600.0, "how long to wait for the stack to come up")
    nvfp4_act_quant: bool = option(False, "NVFP4 checkpoints: emulate W4A4 in the targets and the expert shards")
    dequantise_gguf: bool = options.dequantise_gguf()
    int8_activations: bool = options.int8_activations()
    disable_kernels: str | None = options.disable_kernels()
    rebalance_interval_s: float = option(0.0, "with expert shards: the targets replicate hot experts every this many "
                                              "seconds when the shards' load is out of balance (0 = off)")
    draft_metrics_port: int = option(8071, "draft service /metrics port (with --draft; 0 = off)")
    expert_metrics_port: int = option(8081, "first expert shard's /metrics port, + i for shard i (0 = off)")
    tls_cert: str | None = option(None, "TLS between all services (and on the public gRPC port): the certificate "
                                        "(PEM) every service serves and presents as a client (give it both server "
                                        "and client use and the addresses as SANs)")
    tls_key: str | None = option(None, "TLS: that certificate's private key (PEM)")
    tls_ca: str | None = option(None, "TLS: the CA (PEM) that signed the certificates; every service verifies "
                                      "its peers with it")
    tls_client_auth: bool = option(True, "with TLS: mutual TLS, every service refuses clients without a "
                                         "certificate signed by the CA (the public gRPC port too)")

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        options.check_choice("tool_call_parser", self.tool_call_parser, options.TOOL_CALL_PARSERS)
        options.check_choice("anonymous_prefix_cache", self.anonymous_prefix_cache,
                             options.ANONYMOUS_PREFIX_CACHE)
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template {self.chat_template!r} is not a file")
        parse_hf_overrides(self.hf_overrides)
        check_draft_confidence(self.draft_confidence)
        check_tree_shape(self.draft_tree_nodes)
        check_tree_ngram(self.draft_tree_ngram)
        check_lookup_tokens(self.num_lookup_tokens)
        if self.stream_interval < 0:
            raise ValueError(f"stream_interval must be >= 0, got {self.stream_interval}")
        check_speculative_max_seqs(self.speculative_max_seqs)
        if self.speculative_max_requests < 0:
            raise ValueError(f"speculative_max_requests must be >= 0 (0 = always), got {self.speculative_max_requests}")
        check_wide_threads(self.wide_threads)
        if self.draft_num_threads < 1:
            raise ValueError(f"draft_num_threads must be at least 1, got {self.draft_num_threads}")
        if self.target_replicas < 1:
            raise ValueError(f"target_replicas must be at least 1, got {self.target_replicas}")
        check_kv_store(self.kv_store, self.kv_store_gb, self.kv_store_ttl_s, self.kv_host_gb, self.kv_disk_gb)
        check_write_policy(self.kv_store_write_policy, threshold=self.kv_store_write_threshold)
        if self.prefill_replicas < 0:
            raise ValueError(f"prefill_replicas must be >= 0, got {self.prefill_replicas}")
        options.check_choice("kv_transfer", self.kv_transfer, options.KV_TRANSFERS)
        if self.prefill_replicas and self.kv_transfer == "store" and not self.kv_store:
            raise ValueError("--prefill-replicas with --kv-transfer store hands KV blocks to the decode targets "
                             "through the KV store: give --kv-store redis://host:port/db too (a redis-server it may "
                             "use), or --kv-transfer direct")
        if self.expert_shards < 0:
            raise ValueError(f"expert_shards must be >= 0, got {self.expert_shards}")
        if self.speculative and self.draft:
            raise ValueError("give --speculative (in the target) or --draft (a draft service), not both")
        if len({bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)}) > 1:
            raise ValueError("TLS needs all three of --tls-cert, --tls-key and --tls-ca (or none)")

    def target_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        return [f"{host}:{int(port) + i}" for i in range(self.target_replicas)]

    def expert_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        first = int(port) + self.target_replicas
        return [f"{host}:{first + i}" for i in range(self.expert_shards)]

    def prefill_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        first = int(port) + self.target_replicas + self.expert_shards
        return [f"{host}:{first + i}" for i in range(self.prefill_replicas)]

    def kv_store_args(self, name: str, decode: bool = False) -> list[str]:
        """The block store flags of one target (`name`: its own sub-directory of the disk tier). A decode target
        of P/D with direct transfer keeps a host tier where prefill targets put the blocks (DIRECT_HOST_GB unless
        --kv-host-gb says otherwise). Prefill targets of P/D through the store write every block as it fills, whatever
        the write policy of the others."""
        host = self.kv_host_gb
        if decode and self.prefill_replicas and self.kv_transfer == "direct":
            host = host or DIRECT_HOST_GB
        out = ["--kv-host-gb", str(host)] if host else []
        if self.kv_disk_dir:
            out += ["--kv-disk-dir", os.path.join(self.kv_disk_dir, name), "--kv-disk-gb", str(self.kv_disk_gb)]
        if self.kv_store:
            out += ["--kv-store", self.kv_store, "--kv-store-gb", str(self.kv_store_gb),
                    "--kv-store-ttl-s", str(self.kv_store_ttl_s)]
        if (self.kv_store or self.kv_disk_dir) and self.kv_store_key:
            out += ["--kv-store-key", self.kv_store_key]
        if (self.kv_store or self.kv_disk_dir) and decode:
            out += ["--kv-store-write-policy", self.kv_store_write_policy,
                    "--kv-store-write-threshold", str(self.kv_store_write_threshold)]
        return out

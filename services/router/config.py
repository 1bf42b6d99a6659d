"""The router's settings."""
from __future__ import annotations

import os

from dataclasses import dataclass

from services import options
from shared.config import option
from shared.rpc.server import ConnectionLimits


@dataclass(slots=True)
class RouterConfig(options.TLS):
    address: str = option("127.0.0.1:50051", "public gRPC listen address")
    http_host: str = option("127.0.0.1", "HTTP host for /health and /metrics")
    http_port: int = option(8000, "HTTP port (0 = off)")
    http_max_connections: int = option(1024, "HTTP requests handled at once (idle connections do not count); "
                                             "beyond it the HTTP port answers 503 at once (generations in flight "
                                             "are limited separately by --max-concurrent-requests)")
    http_header_timeout_s: float = option(10.0, "an HTTP connection that has not sent a whole request header this "
                                                "long after it opened is closed (idle keep-alive connections close "
                                                "after 5 s)")
    target: str = option("127.0.0.1:50061", "target replica addresses, comma-separated")
    draft: str | None = option(None, "draft replica addresses, comma-separated: speculative requests go through "
                                     "them, each driving a Verify stream to the chosen target (default: none)")
    speculative_max_requests: int = option(1, "with a draft service: a request speculates only while at most this "
                                              "many requests are in flight here, itself included; above it, it "
                                              "decodes plainly on the target (on a busy batch the relay and the "
                                              "verification rows cost more than speculation saves); 0 = always")
    lookup_speculation: bool = option(False, "the targets draft by prompt lookup the requests sent without a draft "
                                             "service (their --lookup-speculation): a request alone sent so still "
                                             "speculates, so one that asks for num_speculative_tokens 0 measures "
                                             "plain decoding, not the speculation guard's side without drafts")
    prefill_target: str | None = option(None, "prefill-only target addresses, comma-separated (prefill/decode "
                                              "disaggregation): a prompt of at least one full KV block is first "
                                              "computed on one of them, which hands its blocks over (see "
                                              "--kv-transfer); the --target replica then decodes (default: none, "
                                              "every target prefills its own requests)")
    kv_transfer: str = options.kv_transfer()
    registry: str | None = option(None, "prefix-block registry to route by: redis://host:port/db (rediss:// for "
                                         "TLS; default: load only)")
    model: str | None = option(None, "model whose tokenizer and chat template to use (default: SmolLM2-135M-Instruct)")
    chat_template: str | None = option(None, "a Jinja chat template file used instead of the model's own")
    reasoning_parser: str = option("", "think: a chat answer's <think>...</think> (Qwen3, DeepSeek-R1) is returned as "
                                       "reasoning_content apart from content; empty = off")
    tool_call_parser: str = options.tool_call_parser()
    served_model_name: str | None = option(None, "the model's name in the OpenAI API (/v1/models, the `model` of "
                                                 "requests and responses); default: the model's file or folder "
                                                 "name without extension or quantisation suffix")
    max_concurrent_requests: int = option(256, "requests served at once; more get RESOURCE_EXHAUSTED")
    max_n: int = option(16, "largest n (choices per request)")
    max_stop_strings: int = option(16, "most stop strings per request")
    target_wait_s: float = option(600.0, "how long to wait for the target at start-up")
    api_key: str | None = option(None, "require this API key (authorization: Bearer KEY) on gRPC and HTTP")
    api_keys_file: str | None = option(None, "YAML file of API keys with per-key limits (see services/router/auth.py)")
    require_api_key: bool = option(False, "refuse to start without an API key (--api-key or --api-keys-file): for "
                                          "deployments whose ports others can reach (the Kubernetes manifests)")
    request_timeout_s: float = option(600.0, "longest a request may run, from arrival to its last token "
                                             "(DEADLINE_EXCEEDED / HTTP 504 after it); a client's shorter gRPC "
                                             "deadline wins")
    max_request_bytes: int = option(4 * 2**20, "largest request accepted, in bytes: an HTTP body (413 above it) or "
                                               "a gRPC message (RESOURCE_EXHAUSTED)")
    max_prompt_chars: int = option(0, "longest prompt in characters (all messages together), refused before it is "
                                      "tokenised (0 = 32 per token of the context window)")
    cache_secret: str | None = option(None, "with API keys: the secret each key's prefix-cache partition is derived "
                                            "from; give every router of a deployment the same one (default: "
                                            "derived from the configured keys)")
    anonymous_cached_tokens: bool = options.anonymous_cached_tokens()
    anonymous_prefix_cache: str = options.anonymous_prefix_cache()
    max_prompt_tokens: int = option(0, "longest prompt in tokens for every caller (0 = the context window)")
    max_output_tokens: int = option(0, "largest max_tokens for every caller; unset max_tokens is capped to it "
                                       "(0 = the context window)")
    default_max_tokens: int = option(4096, "max_tokens of a request that sets none (within the caller's cap and "
                                           "the context window), so that an unset field cannot take a replica "
                                           "for the rest of the context; 0 = the rest of the context, as vLLM")
    grpc_streams_per_connection: int = option(100, "gRPC port: streams one client connection may have open at once "
                                                   "(more wait for one to end)")
    grpc_max_calls: int = option(4096, "gRPC port: calls served at once over all connections; more are refused "
                                       "with RESOURCE_EXHAUSTED")
    grpc_idle_timeout_s: float = option(300.0, "gRPC port: a client connection without calls for this long is "
                                               "closed (clients reconnect on their next call)")

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.grpc_streams_per_connection, self.grpc_max_calls, self.grpc_idle_timeout_s)

    def draft_addresses(self) -> list[str]:
        return [a.strip() for a in (self.draft or "").split(",") if a.strip()]

    def prefill_addresses(self) -> list[str]:
        return [a.strip() for a in (self.prefill_target or "").split(",") if a.strip()]

    def __post_init__(self) -> None:
        options.check_choice("tool_call_parser", self.tool_call_parser, options.TOOL_CALL_PARSERS)
        options.check_choice("anonymous_prefix_cache", self.anonymous_prefix_cache,
                             options.ANONYMOUS_PREFIX_CACHE)
        if self.require_api_key and not (self.api_key or self.api_keys_file):
            raise ValueError("require_api_key is set but no API key is configured: give --api-key (better: "
                             "UPESI_API_KEY) or --api-keys-file, or set --require-api-key false to serve anyone")
        if self.reasoning_parser not in ("", "think"):
            raise ValueError(f"reasoning_parser must be 'think' or empty, got {self.reasoning_parser!r}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template {self.chat_template!r} is not a file")
        if min(self.max_concurrent_requests, self.max_n, self.http_max_connections) < 1:
            raise ValueError("max_concurrent_requests, max_n and http_max_connections must be positive")
        if self.speculative_max_requests < 0:
            raise ValueError(f"speculative_max_requests must be >= 0 (0 = always), got {self.speculative_max_requests}")
        options.check_choice("kv_transfer", self.kv_transfer, options.KV_TRANSFERS)
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.max_request_bytes < 1024 or self.max_prompt_chars < 0:
            raise ValueError("max_request_bytes must be at least 1024 and max_prompt_chars >= 0 (0 = from the "
                             "context window)")
        if self.grpc_streams_per_connection < 1 or self.grpc_max_calls < 1 or self.grpc_idle_timeout_s <= 0:
            raise ValueError("grpc_streams_per_connection and grpc_max_calls must be >= 1 and grpc_idle_timeout_s "
                             "positive")
        if self.max_prompt_tokens < 0 or self.max_output_tokens < 0 or self.default_max_tokens < 0:
            raise ValueError("max_prompt_tokens, max_output_tokens and default_max_tokens must be >= 0 (0 = no "
                             "limit of their own)")

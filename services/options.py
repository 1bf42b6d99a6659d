"""Options that several services take, each declared once: its default and help text. A service's config dataclass
uses these factories for its fields (`dtype: str = options.dtype()`); `upesi serve` passes them on to the services
it starts under the same flag names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.config import option

DTYPE_HELP = ("float32, bfloat16, float16 or auto (bfloat16 on cuda and on CPUs with native bf16 matmuls, "
              "AVX512-BF16 or AMX; else float32)")
MODEL_HELP = "model: a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)"


def model(help: str = MODEL_HELP) -> Any:
    return option(None, help)


def dtype(help: str = DTYPE_HELP) -> Any:
    return option("auto", help)


def device(help: str = "cpu, cuda or auto") -> Any:
    return option("auto", help)


# ---------------------------------------------------------------- speculative decoding
def num_speculative_tokens() -> Any:
    return option(3, "default K, the draft tokens verified per step")


def num_lookup_tokens() -> Any:
    return option(8, "prompt lookup's chains (where a sequence's text repeats its context): up to this many tokens "
                     "for requests that leave K to the deployment (a copied span is accepted far deeper than a "
                     "draft head's guesses); requests that set num_speculative_tokens get chains of up to theirs")


def adaptive_speculation() -> Any:
    return option(True, "each request's K follows its acceptance (one more after all drafts were accepted, one "
                        "fewer after none, between 1 and K); false: always K")


def prefill_itl_stretch() -> Any:
    return option(2.0, "while sequences decode, a prompt's chunks are sized (by measured step times) to keep a step "
                       "within this many decode-only steps; 0 = off: chunks take the rest of "
                       "--max-num-batched-tokens")


def speculation_guard() -> Any:
    return option(False, "the targets time their decode steps with and without the draft's proposals (per token, per "
                         "batch size) and ask for drafts only while that is the cheaper, trying the other kind every "
                         "16 steps; prompt lookup drafts the text that repeats in both; requests that set their own "
                         "num_speculative_tokens are left as they ask")


def lookup_speculation() -> Any:
    return option(False, "the targets draft by prompt lookup the requests that reach them without a draft service "
                         "(the router's guard or the load kept them from one) where their text repeats its context "
                         "(a rewrite, an edit, a quote): chains of up to --num-lookup-tokens, verified as any "
                         "draft; requests with num_speculative_tokens 0 never speculate")


def speculative_max_seqs(default: int) -> Any:
    return option(default, "the targets speculate only while at most this many sequences are running or waiting to "
                           "be admitted; with more, every sequence decodes plainly until the batch shrinks (on CPUs "
                           "a verification's extra rows cost more than they save once a batch fills the matmuls; "
                           "0 = always)")


def stream_interval() -> Any:
    return option(0, "engine steps between the messages of a running request's token stream (its first tokens and "
                     "its end go at once): fewer messages for the target, the router and the clients to handle on "
                     "the cores the steps need. 0 = by load: every step while fewer than 8 sequences run, then one "
                     "message per running/8 steps (4 at 32)")


def draft_confidence() -> Any:
    return option(None, "eagle heads: stop drafting a sequence once the head's probability of its draft path falls "
                        "below this (0 = always K drafts; default: 0.15)")


def draft_tree_nodes() -> Any:
    return option(None, "eagle heads: greedy requests draft trees (several candidates per depth, up to K depths, "
                        "verified in one pass) of this many nodes per step, shared by the step's greedy sequences; "
                        "0 = chains of K (default: 8)")


def draft_tree_ngram() -> Any:
    return option(None, "eagle heads: graft prompt lookup's continuation of up to this many tokens onto each "
                        "greedy tree (0 = off; default: 4)")


def nvfp4_act_quant() -> Any:
    return option(False, "NVFP4 checkpoints: emulate W4A4 (quantise activations per block of 16)")


def int8_activations() -> Any:
    return option(False, "quantised layers (a GGUF's 4- and 8-bit types, NVFP4) multiply activations quantised to "
                         "int8 per block (W4A8, as llama.cpp does; AVX512-VNNI): about 1.8x faster linears at one "
                         "row, approximate (perplexity in docs/quantised-weights.md); default: exact bf16 activations")


def disable_kernels() -> Any:
    from shared.ops.switches import KERNELS
    return option(None, "comma-separated C kernels to turn off, each then taking its other path (for comparisons "
                        "and diagnosis): " + "; ".join(f"{k}: {v}" for k, v in KERNELS.items()))


def dequantise_gguf() -> Any:
    return option(False, "GGUF files: dequantise their quantised layers to --dtype at load instead of serving the "
                         "codes as they are (4-bit layers then read 3x the bytes a step; for comparisons)")


def expert_placement() -> Any:
    return option(None, "placement JSON of FFN units on the expert shards, or 'replicated' (every unit on every "
                  "shard: one shard may fail; default: contiguous)")


# ---------------------------------------------------------------- KV block store
def kv_store() -> Any:
    return option(None, "KV block store shared by the targets: redis://[:password@]host:port/db, or rediss://...?"
                        "ssl_ca_certs=CA.pem for TLS. Full blocks are written there as they fill (in the background) "
                        "and read on a prefix-cache miss, while reading is measured cheaper than computing "
                        "(default: none)")


def kv_store_key() -> Any:
    return option(None, "secret that authenticates KV blocks on the disk tier and in Redis: each carries a keyed "
                        "MAC, and one without a valid MAC is refused, counted (upesi_kv_store_forged_total) and "
                        "recomputed. Give every target the same key; Redis must not hold it. `upesi serve` makes "
                        "one when unset (kept in --kv-disk-dir/store.key when there is a disk tier)")


def kv_store_gb() -> Any:
    return option(4.0, "size budget of the KV block store in GiB; past it the least recently used blocks go")


def kv_store_ttl_s() -> Any:
    return option(3600.0, "time to live of a block in the KV block store, in seconds, renewed when it is read")


def kv_disk_dir() -> Any:
    return option(None, "local-disk tier of the KV block store: a directory where every full block is written (in "
                        "the background) and read back on a prefix-cache miss, also after a restart (default: none)")


def kv_disk_gb() -> Any:
    return option(10.0, "size budget of the disk tier in GiB; past it the least recently used blocks go")


def kv_store_write_threshold() -> Any:
    return option(1, "write_through_selective: how many new requests must match a cached block (a shared prefix) "
                     "before it is written (1: the first that shares it)")


def kv_store_write_policy() -> Any:
    return option("write_through", "when full KV blocks go to the disk tier and Redis: write_through writes every "
                                   "block as it fills (a replica or a restarted target finds every prefix); "
                                   "write_back only those the paged cache evicts, and on a clean stop the ones it "
                                   "still holds (no writing while a prompt is computed; a crash loses what was "
                                   "cached); write_through_selective those it evicts and those a second request "
                                   "reads from it (shared prefixes)")


def kv_store_sync() -> Any:
    return option(False, "wait after each step until its KV blocks are in the store (the prefill targets of "
                         "prefill/decode disaggregation: the decode target reads them next)")


def kv_host_gb() -> Any:
    return option(0.0, "host memory in GiB for the blocks the KV cache evicts, read back on a later prefix-cache "
                       "miss (0 = off)")


KV_TRANSFERS = ("store", "direct")


def kv_transfer() -> Any:
    return option("direct", "how prefill targets hand KV blocks to decode targets (prefill/decode disaggregation): "
                            "'direct' (they send them over gRPC to the host tier of the decode target the router "
                            "chose, which needs --kv-host-gb; `upesi serve` gives it one) or 'store' (they write "
                            "them to the shared KV store, --kv-store, and the decode target reads them there). "
                            "Direct moves each block once and needs no store (docs/kv-store.md)")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError unless `value` is one of `choices` (the option `name` takes one of a few words)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


# ---------------------------------------------------------------- TLS
@dataclass(slots=True)
class ServerTLS:
    """TLS of a service's own port: a config dataclass that derives from it takes these flags."""
    tls_cert: str | None = option(None, "TLS: this server's certificate (PEM); with tls_key the port serves TLS")
    tls_key: str | None = option(None, "TLS: this server's private key (PEM)")
    tls_client_ca: str | None = option(None, "mTLS: CA (PEM) that client certificates must be signed by; set = "
                                             "clients without one are refused")


@dataclass(slots=True)
class TLS(ServerTLS):
    """TLS of a service's own port and of the calls it makes to other services."""
    tls_ca: str | None = option(None, "TLS to the services this one calls: CA (PEM) that verifies them (set = "
                                      "calls use TLS)")
    tls_client_cert: str | None = option(None, "mTLS: the client certificate (PEM) presented to the services this "
                                               "one calls")
    tls_client_key: str | None = option(None, "mTLS: the client certificate's private key (PEM)")


def anonymous_cached_tokens() -> Any:
    return option(False, "router: report usage's cached_tokens to callers without an API key or a cache_salt of "
                         "their own. They share one partition of the prefix cache, so the count would tell one "
                         "caller whether another sent the same prefix; a server with one user may turn it on")



ANONYMOUS_PREFIX_CACHE = ("shared", "private")


def anonymous_prefix_cache() -> Any:
    return option("shared", "router: the prefix cache of callers without an API key or a cache_salt of their own: "
                            "shared (one partition: a prompt reuses any earlier caller's blocks, so the time to the "
                            "first token can tell a caller that another sent the same prefix) or private (each "
                            "request its own partition: no reuse across requests, nothing to learn)")


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


def tool_call_parser() -> Any:
    return option("hermes", "router: the format of tool calls in a chat answer with tool_choice auto, as the model's "
                            "template teaches it (vLLM's names): hermes (<tool_call> blocks: Qwen, SmolLM, Hermes), "
                            "llama3_json (a JSON object per call: Llama 3.1+), mistral ([TOOL_CALLS]), pythonic "
                            "([name(key=value), ...]: Gemma 3, Llama 3.2 / 4 pythonic templates)")


def hf_overrides() -> Any:
    return option(None, "model config keys to put over the checkpoint's, as a JSON object (vLLM's --hf-overrides): "
                        "e.g. '{\"sliding_window\": 4096}' for a Mistral 7B v0.1 GGUF file, which does not carry "
                        "its window. A GGUF file takes config field names (num_hidden_layers, rope_theta, ...) and "
                        "family fields (sliding_window, ...)")

"""The engine's own settings (the target service's config carries them)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.config import redact_url
from shared.ops.cpu_features import cpu_has_native_bf16
from shared.tree import MAX_TREE_NODES

if TYPE_CHECKING:                      # torch is imported where it is used: `upesi serve` checks its flags
    import torch                       # and starts the services without it


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None              # .gguf file or Hugging Face folder; None = the default model
    hf_overrides: dict | None = None      # config keys put over the checkpoint's (shared.model.loader.load_config)
    device: str = "auto"                  # auto = cuda when present, else cpu
    dtype: str = "float32"                # exact against fp32 references; "auto" as the services' --dtype auto
    block_size: int = 16                  # tokens per KV block
    kv_cache_gb: float = 1.0              # KV memory when num_kv_blocks is not given
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64                # sequences in the running batch
    max_num_batched_tokens: int = 512     # tokens per forward step (chunked prefill budget)
    prefill_chunk_tokens: int = 2048      # the budget of a step while no sequence is decoding (prompts alone)
    prefill_itl_stretch: float = 2.0      # beside decodes, prompt chunks sized to keep their step <= this x a
                                          # decode-only step, measured (shared.engine.prefill_pacer); 0 = off
    max_waiting_seqs: int = 1024          # serving (AsyncEngine): sequences waiting for a batch slot before new
                                          # requests are refused (Overloaded); the offline API queues any number
    max_model_len: int | None = None      # None = the model's context window
    num_threads: int | None = None        # torch intra-op threads on cpu
    wide_threads: int | None = None       # threads of forward steps of WIDE_ROWS rows or more (None = num_threads)
    progress: bool = True                 # progress bar while loading
    enable_prefix_caching: bool = True    # reuse computed full blocks across requests
    kv_store: str | None = None           # block store shared by targets: redis://host:port/db (None = none)
    kv_store_gb: float = 4.0              # its size budget (least recently used blocks go first)
    kv_store_ttl_s: float = 3600.0        # each block's time to live there, renewed when read
    kv_store_sync: bool = False           # each step waits until its blocks are written (prefill-only targets)
    kv_store_write_policy: str = "write_through"   # when blocks go to disk and Redis (WRITE_POLICIES)
    kv_store_write_threshold: int = 1     # write_through_selective: new requests matching a block before it is written
    kv_store_key: str | None = None       # the secret that authenticates blocks on disk and in Redis (a keyed MAC)
    kv_host_gb: float = 0.0               # host-memory tier for blocks the KV cache evicts (0 = off)
    kv_disk_dir: str | None = None        # local-disk tier: a directory for every filled block (None = off)
    kv_disk_gb: float = 10.0              # its size budget (least recently used blocks go first)
    speculative: str | None = None        # proposer: "ngram" or "draft-model:PATH" (None = no speculation)
    num_speculative_tokens: int = 3       # K, the default of requests that do not set it
    num_lookup_tokens: int = 8            # prompt lookup's chains, for requests that do not set K: up to this many
    adaptive_speculation: bool = True     # per request, K follows acceptance (up to K); False: always K
    speculative_max_seqs: int = 0         # speculate only while at most this many sequences run (0 = always)
    speculation_guard: bool = False       # speculate only while it measures cheaper a token (engine.spec_guard)
    draft_confidence: float | None = None  # eagle: stop drafting below this path probability
    draft_tree_nodes: int | None = None   # eagle: tree nodes per step for greedy rows (0 = chains)
    draft_tree_ngram: int | None = None   # eagle: prompt-lookup tokens grafted onto each tree (0 = off)
    # (None: the serving policy, shared.spec.eagle_proposer.SERVING)
    draft_kv_blocks: int = 512            # KV blocks of a draft model
    nvfp4_act_quant: bool = False         # NVFP4 checkpoints: emulate W4A4 (activations quantised per block of 16)
    dequantise_gguf: bool = False         # GGUF files: quantised layers dequantised at load (default: kept packed)
    int8_activations: bool = False        # quantised layers multiply int8-quantised activations (W4A8, approximate)

    def __post_init__(self) -> None:
        if min(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.prefill_chunk_tokens,
               self.max_waiting_seqs) < 1:
            raise ValueError("block_size, max_num_seqs, max_num_batched_tokens, prefill_chunk_tokens and "
                             "max_waiting_seqs must be positive")
        if self.prefill_itl_stretch and self.prefill_itl_stretch <= 1:
            raise ValueError(f"prefill_itl_stretch must be 0 (off) or above 1, got {self.prefill_itl_stretch}")
        check_speculative_max_seqs(self.speculative_max_seqs)
        check_wide_threads(self.wide_threads)
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        check_kv_store(self.kv_store, self.kv_store_gb, self.kv_store_ttl_s, self.kv_host_gb, self.kv_disk_gb)
        check_write_policy(self.kv_store_write_policy, self.kv_store_sync, self.kv_store_write_threshold)
        check_draft_confidence(self.draft_confidence)
        check_tree_shape(self.draft_tree_nodes)
        check_tree_ngram(self.draft_tree_ngram)
        check_lookup_tokens(self.num_lookup_tokens)

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device())


def resolve_device(name: str) -> torch.device:
    """"auto" = cuda when present, else cpu."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype name -> torch's dtype; "auto" as `serving_dtype` resolves it."""
    import torch

    return getattr(torch, serving_dtype(name, device))


DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_dtype(name: str, allowed: tuple[str, ...] = DTYPES, what: str = "dtype") -> None:
    """The one check of a dtype setting (every service config and train-draft call it in __post_init__)."""
    if name not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {name!r}")


def check_kv_store(url: str | None, budget_gb: float, ttl_s: float, host_gb: float, disk_gb: float = 10.0) -> None:
    """The one check of the block store settings (engine, target and serve configs)."""
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"kv_store must be a redis:// URL (redis://host:port/db), got {redact_url(url)!r}")
    if budget_gb <= 0 or ttl_s <= 0:
        raise ValueError(f"kv_store_gb and kv_store_ttl_s must be positive, got {budget_gb} and {ttl_s}")
    if host_gb < 0:
        raise ValueError(f"kv_host_gb must be >= 0 (0 = off), got {host_gb}")
    if disk_gb <= 0:
        raise ValueError(f"kv_disk_gb must be positive, got {disk_gb}")


# every block as it fills / as it leaves the cache (and at a clean stop) / as it leaves the cache or is first reused
WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")


def check_write_policy(policy: str, sync: bool = False, threshold: int = 1) -> None:
    """The one check of the kv_store_write_policy and kv_store_write_threshold settings (engine, target and serve
    configs)."""
    if threshold < 1:
        raise ValueError(f"kv_store_write_threshold must be at least 1, got {threshold}")
    if policy not in WRITE_POLICIES:
        raise ValueError(f"kv_store_write_policy must be one of {', '.join(WRITE_POLICIES)}, got {policy!r}")
    if sync and policy != "write_through":
        raise ValueError("kv_store_sync waits for every block as it fills: it needs kv_store_write_policy "
                         "write_through")


def check_tree_ngram(value: int | None) -> None:
    """The one check of a draft_tree_ngram setting (target, draft and serve configs)."""
    if value is not None and value < 0:
        raise ValueError(f"draft_tree_ngram must be >= 0 (0 = off), got {value}")


def check_lookup_tokens(value: int) -> None:
    """The one check of a num_lookup_tokens setting (engine, target and serve configs)."""
    if value < 1:
        raise ValueError(f"num_lookup_tokens must be >= 1, got {value}")


def check_draft_confidence(value: float | None) -> None:
    """The one check of a draft_confidence setting (target, draft and serve configs)."""
    if value is not None and not 0.0 <= value < 1.0:
        raise ValueError(f"draft_confidence must be in [0, 1), got {value}")


def check_speculative_max_seqs(value: int) -> None:
    """The one check of a speculative_max_seqs setting (engine, target and serve configs): 0 = always."""
    if value < 0:
        raise ValueError(f"speculative_max_seqs must be >= 0 (0 = always speculate), got {value}")


WIDE_ROWS = 4      # a forward step over at least this many rows is "wide" (verification, prefill, a batch)


def check_wide_threads(value: int | None) -> None:
    """The one check of a wide_threads setting (engine, target and serve configs): None or >= 1."""
    if value is not None and value < 1:
        raise ValueError(f"wide_threads must be at least 1, got {value}")


def check_tree_shape(nodes: int | None, width: int = 4) -> None:
    """The one check of draft-tree settings: 0 <= nodes <= MAX_TREE_NODES (0 = chains), width >= 1."""
    if nodes is not None and not 0 <= nodes <= MAX_TREE_NODES:
        raise ValueError(f"draft_tree_nodes must be in [0, {MAX_TREE_NODES}] (0 = chains), got {nodes}")
    if width < 1:
        raise ValueError(f"tree_width must be >= 1, got {width}")


def serving_dtype(name: str, device: torch.device) -> str:
    """The services' "auto": bfloat16 on cuda and on CPUs with native bf16 matmuls (AVX512-BF16 or AMX), else
    float32. Decode on CPU is memory-bound, so bf16 weights halve a step's bytes; and a bf16 matmul over K + 1 rows
    costs about what one row does (fp32's grows with the rows), which is what makes verifying K drafts cheap."""
    check_dtype(name)
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" or cpu_has_native_bf16() else "float32"


def parse_hf_overrides(text: str | None) -> dict | None:
    """--hf-overrides: a JSON object of config keys and values -> the dict (None when unset); ValueError otherwise."""
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"hf_overrides is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"hf_overrides must be a JSON object such as '{{\"sliding_window\": 4096}}', got {text!r}")
    return value

"""The draft service's settings."""
from __future__ import annotations

from dataclasses import dataclass

from services import options
from shared.config import option
from shared.engine.config import check_draft_confidence, check_dtype, check_tree_ngram, check_tree_shape


@dataclass(slots=True)
class DraftConfig(options.TLS):
    address: str = option("127.0.0.1:50071", "gRPC listen address (the router sends speculative requests here)")
    proposer: str = option("ngram", "ngram, draft-model:PATH (a small Llama-family model sharing the tokenizer) "
                                    "or eagle:PATH (an EAGLE-style head trained for the target by train-draft)")
    model: str | None = option(None, "the target's checkpoint, whose embedding, final norm and LM head an eagle "
                                     "head reuses (default: SmolLM2-135M-Instruct)")
    targets: str | None = option(None, "comma-separated host:port of the targets this draft may open Verify streams "
                                       "to (a request naming another is refused with PERMISSION_DENIED); unset = "
                                       "any target the router names")
    draft_confidence: float | None = options.draft_confidence()
    draft_tree_nodes: int | None = options.draft_tree_nodes()
    draft_tree_ngram: int | None = options.draft_tree_ngram()
    block_size: int = option(16, "tokens per KV block of the draft model")
    kv_blocks: int = option(2048, "KV blocks of the draft model")
    max_model_len: int = option(8192, "longest sequence the draft model handles")
    device: str = option("auto", "cpu, cuda or auto")
    dtype: str = options.dtype()
    num_threads: int | None = option(None, "torch CPU threads")
    disable_kernels: str | None = options.disable_kernels()
    metrics_port: int = option(0, "Prometheus /metrics port (0 = off)")

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_draft_confidence(self.draft_confidence)
        check_tree_shape(self.draft_tree_nodes)
        check_tree_ngram(self.draft_tree_ngram)
        if self.targets is not None and not self.allowed_targets():
            raise ValueError("targets: give at least one host:port (or leave it unset)")
        if self.kv_blocks < 1 or self.block_size < 1:
            raise ValueError("kv_blocks and block_size must be positive")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port out of range: {self.metrics_port}")

    def allowed_targets(self) -> frozenset[str] | None:
        """The allow-list of target addresses, or None for any."""
        if self.targets is None:
            return None
        return frozenset(t.strip() for t in self.targets.split(",") if t.strip())

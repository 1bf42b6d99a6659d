"""The architecture-independent description of a decoder checkpoint."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    architecture: str                 # key into shared.model.registry.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)   # family-specific fields (MoE, MLA, ...)

    @property
    def rotary_dim(self) -> int:
        """The dims of a head that RoPE rotates: all of them, or a partial rotary factor's share (Phi-4-mini)."""
        factor = (self.extra.get("partial_rotary_factor")
                  or (self.extra.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
        return int(self.head_dim * factor)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """Builds the config from a Hugging Face `config.json` dict."""
        arch = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        if rope and rope.get("rope_type", rope.get("type")) == "longrope":       # Phi-3: the windows' ratio
            old = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            new = rope.get("max_position_embeddings") or cfg.get("max_position_embeddings")
            rope = {**rope, "original_max_position_embeddings": old, "max_position_embeddings": new}
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_scaling=rope,
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
            name=name,
            extra=cfg,
        )

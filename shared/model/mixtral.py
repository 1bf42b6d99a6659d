"""Mixtral: Llama attention (GQA, RoPE) with a sparse MoE feed-forward in every layer; softmax top-k routing,
renormalised over the chosen experts; no shared expert.

Checkpoint names: `block_sparse_moe.gate` is the router, `block_sparse_moe.experts.{e}.w1 / w3 / w2` are an
expert's gate / up / down projections.
"""
from __future__ import annotations

from shared.model.config import ModelConfig
from shared.model.llama import DecoderLayer
from shared.model.moe import MoEBlock, MoECausalLM, RoutingConfig


class MixtralForCausalLM(MoECausalLM):
    _RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                (".w2.", ".down_proj."))

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        x = cfg.extra
        self.routing = RoutingConfig("softmax_topk", x["num_local_experts"], x["num_experts_per_tok"],
                                     renormalize=True)
        super().__init__(cfg, max_len)

    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        layer.mlp = MoEBlock(i, self.cfg.hidden_size, self.cfg.intermediate_size, self.routing)

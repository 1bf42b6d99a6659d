"""Mixture-of-Experts pieces shared by every MoE family: routing variants, the in-process experts, the MoE block
and the Llama-shaped model skeleton the families fill in.

Shapes: T = tokens in the step, D = hidden, E = routed experts, k = experts per token, I = expert intermediate size,
G = expert groups (DeepSeek-V3).

The seam: MoEBlock computes the router itself and hands every (token, expert) slot of its layer to
`self.backend.moe(layer, hidden, topk_ids, topk_weights)` (shared.model.ffn_backend.ExpertBackend). The default
backend is the block's own LocalExperts; a remote backend replaces it and sends each shard its slots. Shared experts
(Qwen2-MoE, DeepSeek-V3) always run locally. Expert e of layer l is `layers.{l}.mlp.experts.{e}` (a SwiGLU MLP).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig
from shared.model.ffn_backend import ExpertBackend
from shared.model.llama import MLP, DecoderLayer, LlamaForCausalLM, _copy


@dataclass(slots=True, frozen=True)
class RoutingConfig:
    """How one family turns router logits into (expert ids, weights)."""
    kind: str                        # key into ROUTING
    num_experts: int
    top_k: int
    renormalize: bool = True         # weights of the chosen k sum to 1 (Mixtral always; Qwen/DeepSeek: norm_topk_prob)
    n_group: int = 1                 # DeepSeek-V3: experts split in n_group groups, only topk_group groups eligible
    topk_group: int = 1
    scaling_factor: float = 1.0      # DeepSeek-V3: routed_scaling_factor, applied after renormalisation
    fp32_logits: bool = False        # DeepSeek-V3 computes the router matmul in fp32

    def __post_init__(self) -> None:
        if self.kind not in ROUTING:
            raise ValueError(f"routing {self.kind!r} is not supported; known: {sorted(ROUTING)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"{self.num_experts} experts cannot be split in {self.n_group} groups "
                             f"keeping {self.topk_group}")


Routing = Callable[[torch.Tensor, RoutingConfig, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(logits: torch.Tensor, rc: RoutingConfig, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE: softmax over all experts, keep the k largest, optionally renormalise them."""
    probs = logits.float().softmax(dim=-1)                              # [T, E]
    weights, ids = probs.topk(rc.top_k, dim=-1)                         # [T, k]
    if rc.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def sigmoid_group_topk(logits: torch.Tensor, rc: RoutingConfig, bias: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the correction bias only chooses experts (groups ranked by the sum of their two
    best biased scores, then the k best experts inside the topk_group best groups); weights are the unbiased
    scores, renormalised, times routed_scaling_factor."""
    scores = logits.float().sigmoid()                                   # [T, E]
    choice = scores if bias is None else scores + bias.float()          # [T, E], for selection only
    if rc.n_group > 1:
        t, per_group = scores.shape[0], rc.num_experts // rc.n_group
        grouped = choice.view(t, rc.n_group, per_group)                 # [T, G, E/G]
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)   # [T, G]
        best = group_scores.topk(rc.topk_group, dim=-1).indices         # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)   # [T, G]
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(rc.top_k, dim=-1).indices                         # [T, k]
    weights = scores.gather(1, ids)                                     # [T, k]
    if rc.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * rc.scaling_factor


ROUTING: dict[str, Routing] = {
    "softmax_topk": softmax_topk,
    "sigmoid_group_topk": sigmoid_group_topk,
}


class Router(nn.Module):
    """The gate of one MoE layer: weight [E, D] (+ DeepSeek's e_score_correction_bias [E]) -> (ids, weights)."""

    def __init__(self, hidden: int, rc: RoutingConfig, correction_bias: bool = False) -> None:
        super().__init__()
        self.rc, self.route = rc, ROUTING[rc.kind]
        self.weight = nn.Parameter(torch.empty(rc.num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(rc.num_experts), requires_grad=False) \
            if correction_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> topk_ids [T, k] int64, topk_weights [T, k] fp32."""
        if self.rc.fp32_logits:
            logits = F.linear(x.float(), self.weight.float())          # [T, E]
        else:
            logits = F.linear(x, self.weight)
        return self.route(logits, self.rc, self.e_score_correction_bias)


class LocalExperts(nn.ModuleList):
    """Every routed expert of one layer, in this process (the default ExpertBackend); self[e] is expert e."""

    def __init__(self, layer: int, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__(MLP(hidden, inter) for _ in range(num_experts))
        self.layer = layer

    def moe(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
            ) -> torch.Tensor:
        """hidden [T, D], topk_ids / topk_weights [T, k] -> sum_j w[t, j] * expert_{ids[t, j]}(hidden[t])  [T, D].
        Slots are grouped per expert; only the experts hit run, each once on all its tokens."""
        if layer != self.layer:
            raise ValueError(f"experts of layer {self.layer} were asked for layer {layer}")
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)                                     # [T k]
        order = flat.argsort(stable=True)                               # slots grouped by expert, ascending
        tokens = order // k                                             # [T k] token of each grouped slot
        weights = topk_weights.reshape(-1)[order]                       # [T k]
        counts = torch.bincount(flat, minlength=len(self)).tolist()     # the layer's one host sync
        out = torch.zeros_like(hidden)                                  # [T, D]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]                              # [n]
            y = self[e](hidden[rows]) * weights[start:start + n, None]  # [n, D] (fp32 weights, like HF)
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out


class MoEBlock(nn.Module):
    """Router + routed experts (through `backend`) + optional shared expert, optionally sigmoid-gated (Qwen2-MoE)."""

    backend: ExpertBackend

    def __init__(self, layer: int, hidden: int, inter: int, rc: RoutingConfig, shared_inter: int = 0,
                 shared_gate: bool = False, correction_bias: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Router(hidden, rc, correction_bias)
        self.experts = LocalExperts(layer, rc.num_experts, hidden, inter)
        self.shared_expert = MLP(hidden, shared_inter) if shared_inter else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None
        # A plain attribute, not a second registration of the experts' weights; replace it to run experts remotely.
        object.__setattr__(self, "backend", self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        ids, weights = self.gate(x)                                     # [T, k] each
        out = self.backend.moe(self.layer, x, ids, weights)             # [T, D]
        if self.shared_expert is not None:
            shared = self.shared_expert(x)                              # [T, D]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class MoECausalLM(LlamaForCausalLM):
    """Llama's skeleton (embeddings, decoder layers, final norm, head, RoPE, forward) whose layers a family
    rebuilds in `build_layer`, and a loader for Hugging Face names after the family's renames."""

    _RENAMES: tuple[tuple[str, str], ...] = ()          # checkpoint substring -> ours

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        for i, layer in enumerate(self.layers):
            self.build_layer(i, layer)

    def build_layer(self, i: int, layer: DecoderLayer) -> None:
        """Swaps in the family's attention and feed-forward modules of layer i."""
        raise NotImplementedError

    def _our_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        parts = name.split(".")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        if parts[0] == "layers" and int(parts[1]) >= self.cfg.num_layers:
            return None                                 # layers past the decoder (DeepSeek-V3's MTP head)
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors; fused rows are found from each target's own shape, so experts, shared
        experts and dense MLPs of different widths all load."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf, w in weights:
            name = self._our_name(hf)
            if name is None:
                continue
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            target = name if fused is None else ".".join(parts[:-2] + [fused[0], parts[-1]])
            if target not in params:
                raise KeyError(f"checkpoint tensor {hf!r} has no place in {type(self).__name__}")
            if fused is None:
                _copy(params[target], w, hf)
                loaded.add(target)
                continue
            param = params[target]
            rows = param.shape[0]
            offsets = self._fused_offsets(fused[0]) if fused[0] == "qkv_proj" else [0, rows // 2, rows]
            _copy(param.data[offsets[fused[1]]:offsets[fused[1] + 1]], w, hf)
            loaded.add(f"{target}#{fused[1]}")
        expected = set()
        for n in params:
            parts = n.rsplit(".", 2)
            segments = 3 if parts[-2] == "qkv_proj" else 2 if parts[-2] == "gate_up_proj" else 0
            expected |= {f"{n}#{i}" for i in range(segments)} if segments else {n}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

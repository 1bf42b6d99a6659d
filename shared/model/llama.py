"""The Llama-family decoder (Llama, SmolLM, Mistral-style GQA): RMSNorm, RoPE, GQA attention over paged KV,
SwiGLU MLP, optionally tied embeddings.

Shapes: T = new tokens in the step (flattened over sequences), D = hidden, H / KVH = query / kv heads,
Dh = head dim, I = intermediate size, V = vocab.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig
from shared.ops import cpu_attention, decoder_bf16, decoder_f32, rms_norm
from shared.ops.attention import paged_attention
from shared.ops.paged_attention import AttentionMetadata, write_kv
from shared.ops.rope import apply_rope, long_rope_after, rope_tables

KVCache = tuple[torch.Tensor, torch.Tensor]   # per layer: k, v [NB, BS, KVH, Dh]


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), read as transformers reads the config: `layer_types`
    where it lists them (Qwen2/3, Gemma), Qwen's `max_window_layers` (the layers from it on), else the window on
    every layer unless `use_sliding_window` is false (Mistral, Phi-3)."""
    x = cfg.extra
    window = x.get("sliding_window") or None
    if window is None or not x.get("use_sliding_window", True):
        return [None] * cfg.num_layers
    if x.get("layer_types"):
        return [window if t == "sliding_attention" else None for t in x["layer_types"]]
    first = x.get("max_window_layers", 0) if cfg.architecture.startswith("qwen") else 0
    return [window if i >= first else None for i in range(cfg.num_layers)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 like HF, then cast back: in C on CPU where it runs, else in torch.
        if rms_norm.supports(x, self.weight):
            return rms_norm.rms_norm(x, self.weight, self.eps)
        return rms_norm.reference(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, its norm): the residual add and this norm in one pass where the C kernel takes them."""
        if rms_norm.add_supports(x, a, self.weight):
            return rms_norm.add_rms_norm(x, a, self.weight, self.eps)
        s = x + a
        return s, self(s)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.h, self.kvh, self.dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window                                              # sliding window, None: every position
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.dh, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = self.dh ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)                                            # [T, (H + 2 KVH) Dh]
        q = qkv[:, :self.h * self.dh].view(t, self.h, self.dh)            # [T, H, Dh], rows strided
        if not torch.is_grad_enabled() and qkv.is_contiguous() and cpu_attention.supports(q, kv[0]):
            cpu_attention.rope_store(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, self.h, self.kvh, self.dh)
            o = cpu_attention.paged_attention(q, kv[0], kv[1], meta, self.scale, self.window)   # q rotated in place
            return self.o_proj(o.reshape(t, self.h * self.dh))
        q, k, v = qkv.split([self.h * self.dh, self.kvh * self.dh, self.kvh * self.dh], dim=-1)
        q = apply_rope(q.view(t, self.h, self.dh), cos, sin)              # [T, H, Dh]
        k = apply_rope(k.view(t, self.kvh, self.dh), cos, sin)            # [T, KVH, Dh]
        write_kv(kv[0], kv[1], k, v.view(t, self.kvh, self.dh), meta.slot_mapping)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale, self.window)   # [T, H, Dh]
        return self.o_proj(o.reshape(t, self.h * self.dh))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, hidden: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(decoder_bf16.silu_mul(self.gate_up_proj(x)))   # [T, 2I] -> [T, I] -> [T, D]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        x, h = self.step(x, None, cos, sin, meta, kv)
        return x + h

    def step(self, x: torch.Tensor, h: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             meta: AttentionMetadata, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its residual adds fused into the norms after them: x [T, D] the residual stream, h [T, D]
        the previous layer's MLP output not yet added to it (None: nothing pending) -> (x, this layer's MLP output),
        so that x + h is what forward returns."""
        if h is None:
            n = self.input_layernorm(x)
        else:
            x, n = self.input_layernorm.add_forward(x, h)
        x, n = self.post_attention_layernorm.add_forward(x, self.self_attn(n, cos, sin, meta, kv))
        return x, self.mlp(n)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        # built on the meta device by shared.model.registry; with its tensor given, no random init runs (torch's
        # normal_ on meta tensors would load torch._dynamo: a second of every start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.decoder_layer(cfg, w) for w in layer_windows(cfg))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, max_len, cfg.rope_scaling)
        self.max_len, self.long_rope_after = max_len, long_rope_after(cfg.rope_scaling, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)            # [P, Dh]
        self.register_buffer("rope_sin", sin, persistent=False)

    def decoder_layer(self, cfg: ModelConfig, window: int | None) -> nn.Module:
        """One decoder layer of the family (a sliding window or None)."""
        return DecoderLayer(cfg, window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, D] (before the LM head)."""
        x = self.embed_tokens(input_ids)                                   # [T, D]
        rows = positions
        if self.long_rope_after is not None and meta.long_rope is not None and any(meta.long_rope):
            dev = positions.device                                         # LongRoPE past its original window
            long = torch.tensor(meta.long_rope, device=dev).repeat_interleave(torch.tensor(meta.query_lens,
                                                                                           device=dev))   # [T]
            rows = positions + long.to(positions.dtype) * self.max_len     # the long-factor half of the tables
        cos = self.rope_cos[rows].to(x.dtype)                              # [T, Dh]
        sin = self.rope_sin[rows].to(x.dtype)
        stack = self._decoder_stack(kv_caches)
        if stack is not None and stack.takes(x, meta):                     # a few bf16 rows: every layer in C
            return self.norm(stack.run(x, cos, sin, meta))
        if all(type(layer) is DecoderLayer and not (layer._forward_hooks or layer._forward_pre_hooks)
               for layer in self.layers):                                  # each layer's last add fused into the next
            h = None
            for layer, kv in zip(self.layers, kv_caches):
                x, h = layer.step(x, h, cos, sin, meta, kv)
            return self.norm(x + h)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)

    def _decoder_stack(self, kv_caches: list[KVCache]) -> decoder_bf16.DecoderStack | None:
        """The layers as one C call (shared.ops.decoder_bf16) where every one is this file's plain decoder layer
        with bf16 rows-packed linears on CPU; built at first use and again whenever a layer's FFN or the cache
        changed (an FFN moved to expert shards)."""
        key = (kv_caches[0][0], *(layer.mlp for layer in self.layers)) if kv_caches else ()
        cached = getattr(self, "_stack", None)
        if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        stack = _build_stack(self, kv_caches) if key else None
        self._stack = (key, stack)
        return stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] in fp32."""
        head = self.lm_head
        if hidden.device.type != "cpu" or type(head) is not nn.Linear:
            return head(hidden).float()                     # bf16, or fp32 with the rows kernel: a PackedLinear
        # fp32 on CPU: the [V, D] head is the largest matmul of a decode step. Measured on 2 cores (V = 49152,
        # D = 576): one row streams a [D, V] copy about 1.8x faster, and several rows go about 1.4x faster in V-chunks.
        if hidden.shape[0] < 4:
            if getattr(self, "_head_t", None) is None or self._head_t.shape != head.weight.t().shape:
                self._head_t = head.weight.detach().t().contiguous()                # [D, V]
            return (hidden @ self._head_t).float()
        return torch.cat([F.linear(hidden, w) for w in head.weight.split(4096)], dim=-1).float()

    # ---------------------------------------------------------------- weights
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is None:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                _copy(params[name], w, name)
                seen.add(name)
                continue
            target_name = ".".join(parts[:-2] + [fused[0], parts[-1]])
            param = params[target_name]
            offsets = self._fused_offsets(fused[0])
            lo, hi = offsets[fused[1]], offsets[fused[1] + 1]
            _copy(param.data[lo:hi], w, name)
            seen.add(f"{target_name}#{fused[1]}")
        expected = sum(3 if "qkv" in n else 2 if "gate_up" in n else 1 for n in params
                       if not (n == "lm_head.weight" and self.cfg.tie_word_embeddings))
        if len(seen) != expected:
            raise ValueError(f"checkpoint is missing tensors: {expected - len(seen)} of {expected} not loaded")

    def _fused_offsets(self, kind: str) -> list[int]:
        c = self.cfg
        if kind == "qkv_proj":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [0, q, q + kv, q + 2 * kv]
        return [0, c.intermediate_size, 2 * c.intermediate_size]


def _build_stack(model: LlamaForCausalLM, kv_caches: list[KVCache]) -> decoder_bf16.DecoderStack | None:
    cfg = model.cfg
    k0 = kv_caches[0][0]
    fp32 = k0.dtype == torch.float32             # fp32 rows: every linear block-quantised, on the AVX2 kernel
    kinds = ((decoder_bf16.QWeight,) if fp32 else    # else bf16 panels or codes for shared.ops.qgemm / qgemm_i8
             (decoder_bf16.RowsWeightBF16, decoder_bf16.QWeight, decoder_bf16.QWeightI8))

    def rows_packed(m: nn.Module) -> bool:
        return isinstance(getattr(m, "packed", None), kinds)

    if not (k0.device.type == "cpu" and (decoder_f32.available() if fp32 else
                                         k0.dtype == torch.bfloat16 and decoder_bf16.available())
            and len(kv_caches) == len(model.layers) and cfg.head_dim % 8 == 0 and cfg.head_dim <= 512
            and cfg.num_heads % cfg.num_kv_heads == 0 and cfg.num_heads // cfg.num_kv_heads <= 8):
        return None
    layers = []
    for layer, (k, v) in zip(model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        if not (type(layer) is DecoderLayer and type(attn) is Attention and type(mlp) is MLP
                and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                and all(rows_packed(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
                and k.dtype == v.dtype == k0.dtype):
            return None
        layers.append(decoder_bf16.LayerWeights(
            layer.input_layernorm.weight.detach(), attn.qkv_proj.packed, attn.qkv_proj.bias, attn.o_proj.packed,
            attn.o_proj.bias, layer.post_attention_layernorm.weight.detach(), mlp.gate_up_proj.packed,
            mlp.gate_up_proj.bias, mlp.down_proj.packed, mlp.down_proj.bias, k, v, attn.window))
    eps = {layer.input_layernorm.eps for layer in model.layers} | {layer.post_attention_layernorm.eps
                                                                    for layer in model.layers}
    if len(eps) != 1:
        return None
    return decoder_bf16.DecoderStack(layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps.pop(), k0.dtype)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama decoder, with the sliding window of its config (Mistral 7B v0.1) on every layer."""

"""An EAGLE-1 style draft head: predicts the target's next last-layer feature from the target's own features.

At position p the head reads the pair (f_p, x_{p+1}): the target's feature at p and the embedding of the token that
followed. fc(concat(embedding, feature)) -> one Llama decoder layer -> a predicted feature f^_{p+1}; the target's LM
head on it gives the distribution of x_{p+2}. The feature is what the target's LM head reads, i.e. the last hidden
state after the final norm, as in EAGLE-1 (`post_norm`); heads with post_norm = False read and predict the hidden
state before the norm (whose few huge dimensions make it a much harder regression target) and put the target's norm
in front of the LM head instead. To draft K tokens the
head runs once over the new real features of a sequence, then K - 1 more times on its own predicted features.
The LM head is restricted to the N most frequent tokens of the target (an id map), which is most of the saving.

The head stores only its own weights (fc, the layer), the id map and a small config; the embedding, final norm and
LM head rows come from the target (shared tensors in-process, loaded from the checkpoint in a draft service).
Shapes: B = sequences, T = new positions, P = cached positions, D = hidden, N = reduced vocab, V = full vocab,
KVH / H = kv / query heads, Dh = head dim.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.llama import MLP, RMSNorm
from shared.ops import qgemm, qgemm_i8
from shared.ops.block_quant import BlockQuant
from shared.ops.qgemm import QWeight
from shared.ops.packed_linear import pack_linears, pack_weight, packable, packed_linear
from shared.ops.paged_attention import gqa_attention
from shared.ops.rope import apply_rope, rope_tables

HEAD_FILE, CONFIG_FILE = "head.safetensors", "eagle.json"


@dataclass(slots=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int                 # the target's
    draft_vocab_size: int           # N, rows of the id map
    max_position: int = 8192
    post_norm: bool = False         # features after the target's final norm (EAGLE-1); False: before it
    rotary_dim: int | None = None   # the rotated dims of a head, as its target's (None: all of head_dim)

    @classmethod
    def read(cls, folder: str) -> "EagleConfig":
        """The config saved beside a head (eagle.json). Keys that are not the model's (serving settings that older
        heads carried, such as draft_confidence or tree_nodes) are ignored: serving takes them from its flags."""
        import os

        with open(os.path.join(folder, CONFIG_FILE)) as f:
            saved = json.load(f)
        return cls(**{k: v for k, v in saved.items() if k in cls.__dataclass_fields__})


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, kvh, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, (h + 2 * kvh) * dh, bias=False)
        self.o_proj = nn.Linear(h * dh, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size)
        self.register_buffer("id_map", torch.arange(cfg.draft_vocab_size))       # [N] reduced -> full id
        cos, sin = rope_tables(cfg.rotary_dim or dh, cfg.rope_theta, cfg.max_position, None)
        self.register_buffer("rope_cos", cos, persistent=False)                 # [P, R], R = rotated dims
        self.register_buffer("rope_sin", sin, persistent=False)
        # The target's parts, attached by `attach_target` (not saved with the head).
        self.embed: torch.Tensor | None = None          # [V, D]
        self.final_norm: nn.Module | None = None
        self.head_rows: torch.Tensor | None = None      # [N, D], the LM head's rows of the reduced vocab
        self.packed_rows: torch.Tensor | None = None    # head_rows prepacked (serving in bf16 on CPU: `pack`)
        self.int8_rows: QWeight | qgemm_i8.QWeightI8 | None = None   # or int8 blocks (`pack(int8_head=True)`)

    @property
    def dtype(self) -> torch.dtype:
        return self.input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_layernorm.weight.device

    def pack(self, int8_head: bool = False) -> None:
        """Serving only (not trainable after): bf16 CPU weights prepacked for oneDNN (shared.ops.packed_linear),
        bit-identical and about 2x faster; a no-op elsewhere. int8_head: the LM head's rows (the largest read of a
        draft pass) as int8 blocks of 32, half the bytes, multiplied on int8 activations (shared.ops.qgemm_i8)
        where that kernel runs, else by the quantised rows kernel (shared.ops.qgemm); the drafts then follow
        slightly different logits, which is the head's own business (q is what it used)."""
        pack_linears(self)
        rows = self.head_rows
        if rows is None:
            return
        if (int8_head and rows.device.type == "cpu" and rows.dtype == torch.bfloat16 and rows.shape[0] % 32 == 0
                and rows.shape[1] % 32 == 0 and qgemm.available()):                # int8 activations too, where
            bq = BlockQuant.int8(rows)                                               # they run: 2x at one row
            self.int8_rows = qgemm_i8.pack(bq) or QWeight(bq)
        elif packable(rows):
            self.packed_rows = pack_weight(rows)

    def attach_target(self, embed: torch.Tensor, norm: nn.Module, lm_head: torch.Tensor) -> None:
        self.embed = embed
        object.__setattr__(self, "final_norm", norm)          # the target's module: not a submodule, never saved
        self.head_rows = lm_head[self.id_map].to(self.dtype).contiguous()  # [N, D], in the head's dtype
        self.packed_rows = self.int8_rows = None

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """feats [B, T, D], tokens / positions [B, T], past k / v [B, P, KVH, Dh], mask [B, T, P + T] (True = attend)
        -> predicted features [B, T, D] and this step's k, v [B, T, KVH, Dh]."""
        c = self.cfg
        b, t, _ = feats.shape
        x = self.fc(torch.cat([self.embed[tokens].to(feats.dtype), feats], dim=-1))    # [B, T, D]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
        cos = self.rope_cos[positions.flatten()].to(x.dtype)                          # [B T, Dh]
        sin = self.rope_sin[positions.flatten()].to(x.dtype)
        q = apply_rope(q.reshape(b * t, c.num_heads, c.head_dim), cos, sin).view(b, t, c.num_heads, c.head_dim)
        k = apply_rope(k.reshape(b * t, c.num_kv_heads, c.head_dim), cos, sin).view(b, t, c.num_kv_heads, c.head_dim)
        v = v.view(b, t, c.num_kv_heads, c.head_dim)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        o = gqa_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask[:, None],
                          c.head_dim ** -0.5)                                        # [B, H, T, Dh]
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's last hidden states before its final norm [..., D] -> the features this head reads."""
        return self.final_norm(hidden) if self.cfg.post_norm else hidden

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., D] (this head's feature space) -> logits over the reduced vocab [..., N] in fp32."""
        x = feats if self.cfg.post_norm else self.final_norm(feats)
        if isinstance(self.int8_rows, qgemm_i8.QWeightI8):
            return qgemm_i8.linear(x, self.int8_rows, out=torch.float32)
        if self.int8_rows is not None:
            return qgemm.linear(x, self.int8_rows).float()
        if self.packed_rows is not None:
            return packed_linear(x, self.packed_rows).float()
        return F.linear(x, self.head_rows).float()

    # ---------------------------------------------------------------- files
    def save(self, folder: str, dtype: torch.dtype = torch.float16) -> None:
        import os

        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(folder, HEAD_FILE))
        with open(os.path.join(folder, CONFIG_FILE), "w") as f:
            json.dump(asdict(self.cfg), f, indent=1)

    @classmethod
    def load(cls, folder: str, dtype: torch.dtype, device: torch.device) -> "EagleHead":
        import os

        from safetensors.torch import load_file

        head = cls(EagleConfig.read(folder))
        head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                              for k, v in load_file(os.path.join(folder, HEAD_FILE)).items()})
        return head.to(device=device, dtype=dtype).eval()


def causal_mask(past_lens: list[int], new_lens: list[int], device: torch.device) -> torch.Tensor:
    """Right-padded rows: row i has past_lens[i] cached keys (padded to P) then new_lens[i] new ones (padded to T).
    -> [B, T, P + T] bool. Padded query rows attend to their first key so that no row is all masked."""
    p, t = max(past_lens), max(new_lens)
    kpos = torch.arange(p + t, device=device)                                  # [P + T]
    qpos = torch.arange(t, device=device)                                      # [T]
    past = torch.tensor(past_lens, device=device)[:, None, None]               # [B, 1, 1]
    new = torch.tensor(new_lens, device=device)[:, None, None]
    in_past = kpos[None, None, :] < past
    in_new = (kpos[None, None, :] >= p) & (kpos[None, None, :] - p <= qpos[None, :, None]) & (kpos - p < new)
    mask = in_past | in_new
    mask[..., 0] |= ~mask.any(-1)
    return mask


def head_config_for(target_cfg, draft_vocab_size: int, post_norm: bool = False) -> EagleConfig:
    """A head shaped like one layer of the target (a shared.model.config.ModelConfig)."""
    return EagleConfig(post_norm=post_norm, hidden_size=target_cfg.hidden_size,
                       intermediate_size=target_cfg.intermediate_size,
                       num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
                       head_dim=target_cfg.head_dim, rms_norm_eps=target_cfg.rms_norm_eps,
                       rope_theta=target_cfg.rope_theta, vocab_size=target_cfg.vocab_size,
                       draft_vocab_size=draft_vocab_size, max_position=target_cfg.max_position_embeddings,
                       rotary_dim=target_cfg.rotary_dim if target_cfg.rotary_dim != target_cfg.head_dim else None)


def load_target_parts(path: str | None, dtype: torch.dtype, device: torch.device
                      ) -> tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """(embedding [V, D], final norm, LM head [V, D]) read from a target checkpoint, without building the model."""
    from shared.model.loader import iter_weights, load_config
    from shared.model_files import resolve_model_path

    path = resolve_model_path(path)
    cfg = load_config(path)
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    got = dict(iter_weights(path, cfg, progress=False, keep=want.__contains__))
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.data = got["model.norm.weight"].to(device=device, dtype=dtype)
    embed = got["model.embed_tokens.weight"].to(device=device, dtype=dtype)
    lm_head = got["lm_head.weight"].to(device=device, dtype=dtype) if "lm_head.weight" in got else embed
    return embed, norm.eval(), lm_head

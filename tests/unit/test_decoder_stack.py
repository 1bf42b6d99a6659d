"""The decoder stack in one C call (shared/ops/decoder_bf16.c for bf16, decoder_f32.c for fp32 rows on the AVX2
quantised kernel) against the model's modules, and their SwiGLU activations against torch's."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM
from shared.ops import cpu_attention, decoder_bf16, decoder_f32, prefill_attention, qgemm
from shared.ops.packed_linear import pack_linears
from shared.ops.paged_attention import AttentionMetadata, paged_attention_ref
from shared.ops.qgemm_i8 import QWeightI8
from shared.quant.quant_linear import QuantLinear
from shared.tree import ancestor_mask, depths

needs_bf16 = pytest.mark.skipif(not decoder_bf16.available(), reason="needs AVX512-BF16 and a C compiler")
needs_f32 = pytest.mark.skipif(not decoder_f32.available(),
                               reason="needs the AVX2 quantised kernel (a CPU with AVX2 and no AVX512-BF16)")

NB, BS = 48, 16
STEPS = [([37], [1], {}),                                                 # one decode
         ([37, 5, 60, 20], [1, 1, 1, 1], {}),                             # a batch of decodes
         ([37, 30, 12], [1, 9, 6], {1: [-1, -1, 0, 0, 1, 2, 4, 6]})]      # a decode, a tree, a short prefill chunk


def tiny_model(attention_bias: bool = False, seed: int = 0, window: int | None = None, rotary: float = 1.0,
               dtype: torch.dtype = torch.bfloat16, inter: int = 200, head_dim: int = 16) -> LlamaForCausalLM:
    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=96, intermediate_size=inter, num_layers=3,
                      num_heads=6, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=512, attention_bias=attention_bias, mlp_bias=attention_bias,
                      extra={"sliding_window": window, "layer_types": ["sliding_attention", "full_attention",
                                                                       "sliding_attention"],
                             "partial_rotary_factor": rotary})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, 512)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model = model.to(dtype).eval()
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    pack_linears(model, keep_weight=("lm_head",))
    return model


def quantise(model: LlamaForCausalLM, kind: str, names: tuple[str, ...], seed: int = 4, int8: bool = False,
             block: int = 32) -> None:
    """The named linears of every layer replaced by block-quantised ones (shared.ops.qgemm) of random codes
    (int8: with int8 activations, shared.ops.qgemm_i8, where it runs)."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for name in names:
            parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            old = getattr(parent, name)
            q = QuantLinear(old.in_features, [old.out_features], bias=old.bias is not None)
            q.int8_activations = int8
            q.load_segment(0, qgemm.example(kind, old.out_features, old.in_features, block, g))
            q.bias = old.bias
            setattr(parent, name, q)


def step(lens: list[int], qlens: list[int], trees: dict[int, list[int]],
         prompts: list[bool] | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and metadata of sequences with shuffled blocks; sequence b's new tokens are its last
    qlens[b] (a draft tree's nodes sit at their depth after the root); prompts: which rows are prompt chunks."""
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(5)).tolist()
    tables, slots, starts, pos = [], [], [0], []
    for b, (length, n) in enumerate(zip(lens, qlens)):
        table, perm = perm[:-(-length // BS)], perm[-(-length // BS):]
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(length - n, length)]
        c = length - n
        pos += [c] + [c + d for d in depths(trees[b])] if b in trees else list(range(c, length))
        starts.append(starts[-1] + n)
    mb = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (mb - len(t)) for t in tables]),
        seq_lens=torch.tensor(lens), query_start_loc=torch.tensor(starts),
        num_decodes=sum(1 for n in qlens if n == 1), query_lens=qlens, seq_lens_host=lens, max_query_len=max(qlens),
        tree_masks={b: ancestor_mask(p) for b, p in trees.items()}, prompt_chunks=prompts)
    return torch.tensor(pos), meta


def caches(model: LlamaForCausalLM, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape, dtype = (NB, BS, model.cfg.num_kv_heads, model.cfg.head_dim), model.embed_tokens.weight.dtype
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in model.layers]


def module_path(model: LlamaForCausalLM, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The model's hidden states after the final norm, layer by layer through its modules (the reference)."""
    x = model.embed_tokens(ids)
    cos, sin = model.rope_cos[pos].to(x.dtype), model.rope_sin[pos].to(x.dtype)
    for layer, layer_kv in zip(model.layers, kv):
        x = layer(x, cos, sin, meta, layer_kv)
    return model.norm(x)


def assert_same(got: torch.Tensor, want: torch.Tensor, kv_stack: list[tuple[torch.Tensor, torch.Tensor]],
                kv_mod: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Both paths' hidden states, and the keys and values each wrote, equal bit for bit."""
    assert torch.equal(got, want)
    for (k1, v1), (k2, v2) in zip(kv_stack, kv_mod):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@needs_bf16
@pytest.mark.parametrize("bias,window,rotary", [(False, None, 1.0), (True, None, 1.0), (False, 7, 1.0),
                                                (False, None, 0.5)])                  # 0.5: partial rotary
@pytest.mark.parametrize("lens,qlens,trees", STEPS)
def test_stack_equals_modules_bit_for_bit(bias, window, rotary, lens, qlens, trees, monkeypatch):
    model = tiny_model(attention_bias=bias, window=window, rotary=rotary)
    assert model.rope_cos.shape[-1] == int(16 * rotary)
    assert [layer.self_attn.window for layer in model.layers] == [window, None, window]
    kv_stack, kv_mod = caches(model, 1), caches(model, 1)
    pos, meta = step(lens, qlens, trees)
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_stack)
        assert model._stack[1] is not None, "the C stack was not built for a plain bf16 Llama"
        assert model._stack[1].takes(model.embed_tokens(ids), meta)
        want = module_path(model, ids, pos, meta, kv_mod)
    assert_same(got, want, kv_stack, kv_mod)


@needs_bf16
@pytest.mark.skipif(not prefill_attention.available(64), reason="needs the prefill attention kernel")
@pytest.mark.parametrize("window", [None, 100])
def test_prompt_chunk_through_the_prefill_kernel_equals_modules_bit_for_bit(window):
    """Decodes beside a 21-row prompt chunk resuming mid-block at position 479 (heads of 64): C hands the chunk to
    the prefill kernel, as the modules do, and leaves the decodes to the row kernel."""
    model = tiny_model(window=window, head_dim=64)
    kv_stack, kv_mod = caches(model, 1), caches(model, 1)
    (pos, meta), (_, meta_mod) = (step([37, 500, 5], [1, 21, 1], {}, prompts=[False, True, False]) for _ in "ab")
    assert cpu_attention.tiled_chunks(meta) == {1}
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_stack)
        assert model._stack[1] is not None and model._stack[1].takes(model.embed_tokens(ids), meta)
        want = module_path(model, ids, pos, meta_mod, kv_mod)      # its own metadata: rows split afresh
    assert torch.equal(got, want)


@needs_bf16
@pytest.mark.parametrize("kind", ["u4", "i8"])
def test_stack_with_quantised_layers_equals_modules_bit_for_bit(kind):
    """Linears kept block-quantised (shared.ops.qgemm) beside bf16 ones: each layer's GEMM is its own."""
    if not qgemm.available():
        pytest.skip("needs the quantised kernel")
    model = tiny_model(attention_bias=True)
    quantise(model, kind, ("qkv_proj", "o_proj", "gate_up_proj"))          # down_proj (K = 200) stays bf16
    kv_stack, kv_mod = caches(model, 1), caches(model, 1)
    pos, meta = step([37, 30, 12], [1, 9, 6], {1: [-1, -1, 0, 0, 1, 2, 4, 6]})
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_stack)
        assert model._stack[1] is not None
        want = module_path(model, ids, pos, meta, kv_mod)
    assert torch.equal(got, want)


@needs_bf16
@pytest.mark.skipif(not prefill_attention.available(64), reason="needs the prefill attention kernel")
@pytest.mark.parametrize("kind,inter", [("u4", 200), ("u4", 256), ("nvfp4", 256), ("bf16", 200)])
@pytest.mark.parametrize("rows,window", [(150, None), (150, 100), (90, None)])
def test_prefill_chunk_of_many_rows_equals_modules_bit_for_bit(kind, inter, rows, window):
    """A prompt chunk longer than the row kernels' limit (resuming mid-block at position 300, beside two decodes)
    goes through C too: its attention on the prefill kernel, the block-quantised linears on the fused
    dequantise-GEMM from qgemm.WIDE_ROWS rows on (as qgemm.run multiplies them; on AMX a gate_up of I = 256 writes
    SwiGLU's activation itself), the same bits as the modules."""
    model = tiny_model(window=window, head_dim=64, attention_bias=kind == "u4", inter=inter)
    if kind != "bf16":
        if qgemm.wide_kernel_address() == 0:
            pytest.skip("needs the fused dequantise-GEMM")
        names = ("qkv_proj", "o_proj", "gate_up_proj") + (("down_proj",) if inter % 32 == 0 else ())
        quantise(model, kind, names, block=16 if kind == "nvfp4" else 32)
    kv_stack, kv_mod = caches(model, 1), caches(model, 1)
    lens, qlens = [37, 300 + rows, 5], [1, rows, 1]
    (pos, meta), (_, meta_mod) = (step(lens, qlens, {}, prompts=[False, True, False]) for _ in "ab")
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_stack)
        stack = model._stack[1]
        assert stack is not None and stack.takes(model.embed_tokens(ids), meta)
        assert stack._table(rows + 2) is (stack._wide if rows + 2 >= qgemm.WIDE_ROWS else stack._ptrs)
        fused = kind != "bf16" and inter % 32 == 0 and qgemm.wide_swiglu_address() != 0
        assert bool(stack._table(150)[:, -1].all()) == fused
        want = module_path(model, ids, pos, meta_mod, kv_mod)
    assert_same(got, want, kv_stack, kv_mod)


@needs_bf16
@pytest.mark.skipif(not prefill_attention.available(64), reason="needs the prefill attention kernel")
def test_long_steps_take_the_modules_where_c_has_no_kernel_for_them():
    """Past qgemm.fused_max_rows() rows, with int8 activations, or where a long chunk is a draft tree's, the
    modules run the step."""
    model = tiny_model(head_dim=64)
    quantise(model, "u4", ("qkv_proj",))
    kv = caches(model, 3)
    pos, meta = step([40], [1], {})
    with torch.inference_mode():
        model(torch.tensor([7]), pos, meta, kv)
        stack = model._stack[1]
        x = torch.zeros(200, 96, dtype=torch.bfloat16)
        _, long_meta = step([300], [200], {}, prompts=[True])
        assert stack.takes(x, long_meta) == (qgemm.wide_kernel_address() != 0)
        long_meta.tree_masks = {0: torch.ones(200, 200, dtype=torch.bool)}
        assert not stack.takes(x, long_meta)
        with mock.patch.object(qgemm, "fused_max_rows", lambda: 150):
            assert stack._table(200) is None and stack._table(150) is stack._wide
        model = tiny_model(head_dim=64)
        quantise(model, "u4", ("o_proj",), int8=True)
        if not isinstance(model.layers[0].self_attn.o_proj.packed, QWeightI8):
            pytest.skip("needs the int8-activation kernel")
        model(torch.tensor([7]), pos, meta, kv)
        assert model._stack[1]._wide is None and not model._stack[1].takes(x, step([300], [200], {}, [True])[1])


@needs_bf16
def test_stack_is_rebuilt_when_a_layer_changes_and_skipped_for_long_steps():
    model = tiny_model()
    kv = caches(model, 3)
    pos, meta = step([40], [1], {})
    with torch.inference_mode():
        model(torch.tensor([7]), pos, meta, kv)
        first = model._stack[1]
        assert first is not None
        model.layers[1].mlp = torch.nn.Identity()             # another kind of FFN: the modules run every layer
        model(torch.tensor([7]), pos, meta, kv)
        assert model._stack[1] is None
    assert not first.takes(torch.zeros(decoder_bf16.max_rows() + 1, 96, dtype=torch.bfloat16), meta)
    assert not first.takes(torch.zeros(1, 96), meta)         # fp32


@needs_bf16
def test_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(7, 2 * 53, generator=g) * torch.tensor([0.01, 1.0, 8.0, 40.0, 100.0, 0.3, 3.0])[:, None])
    gu = gu.bfloat16()
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    got, want = decoder_bf16.silu_mul(gu), decoder_bf16.silu_mul_reference(gu)
    assert got.dtype == torch.bfloat16 and got.shape == (7, 53)
    # torch's exp and the kernel's may differ in the last fp32 bit, so at most one bf16 rounding step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-30)
    assert (got != want).float().mean() < 0.01
    f32 = gu.float()
    assert torch.equal(decoder_bf16.silu_mul(f32), decoder_bf16.silu_mul_reference(f32))   # fp32: torch itself


@needs_bf16
def test_silu_mul_of_every_bf16_gate_matches_torch():
    """The activation of each of the 65,536 bf16 gates (zeros, subnormals, huge values, infinities, NaNs) times
    one: within one bf16 rounding of torch's, NaN where torch's is."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = decoder_bf16.silu_mul(torch.cat([gate, torch.ones(65536, dtype=torch.bfloat16)])[None])[0].float()
    want = F.silu(gate).float()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got[~got.isnan()], want[~want.isnan()], rtol=2 ** -7, atol=1e-30)
    assert (got != want)[~got.isnan()].float().mean() < 0.01


@needs_f32
@pytest.mark.parametrize("kind", ["u4", "i8", "e2m1"])
@pytest.mark.parametrize("bias,window,rotary", [(False, None, 1.0), (True, 7, 1.0), (False, None, 0.5)])
@pytest.mark.parametrize("lens,qlens,trees", STEPS)
def test_f32_stack_equals_modules_bit_for_bit(kind, bias, window, rotary, lens, qlens, trees):
    model = tiny_model(attention_bias=bias, window=window, rotary=rotary, dtype=torch.float32, inter=192)
    quantise(model, kind, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    kv_stack, kv_mod = caches(model, 1), caches(model, 1)
    pos, meta = step(lens, qlens, trees)
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_stack)
        assert model._stack[1] is not None and model._stack[1].dtype == torch.float32
        want = module_path(model, ids, pos, meta, kv_mod)
    assert_same(got, want, kv_stack, kv_mod)
    # and the module path is the model: the dequantised weights through torch's own ops agree to fp32 rounding
    with torch.inference_mode():
        ref = reference_f32(model, ids, pos, meta, caches(model, 1))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_f32
@pytest.mark.skipif(not prefill_attention.f32_kernel(64), reason="needs the fp32 prefill attention kernel")
@pytest.mark.parametrize("window", [None, 100])
def test_f32_prompt_chunk_through_the_prefill_kernel_equals_modules_bit_for_bit(window, monkeypatch):
    """fp32: decodes beside a 21-row prompt chunk resuming mid-block at position 479 (heads of 64, 3 query heads a
    key head): C hands the chunk to
    prefill_attention_f32.c, as the modules do (torch's SDPA made to fail), and matches the reference."""
    monkeypatch.setattr(prefill_attention, "_sdpa", None)
    model = tiny_model(window=window, head_dim=64, dtype=torch.float32, inter=192)
    quantise(model, "u4", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    kv_stack, kv_mod, kv_ref = caches(model, 1), caches(model, 1), caches(model, 1)
    (pos, meta), (_, meta_mod), (_, meta_ref) = (step([37, 5, 500], [1, 1, 21], {}, prompts=[False, False, True])
                                                for _ in "abc")           # the reference takes decodes first
    assert cpu_attention.tiled_chunks(meta, fp32=True) == {2}
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_stack)
        assert model._stack[1] is not None and model._stack[1].takes(model.embed_tokens(ids), meta)
        want = module_path(model, ids, pos, meta_mod, kv_mod)
        with mock.patch.object(cpu_attention, "paged_attention", paged_attention_ref):
            ref = reference_f32(model, ids, pos, meta_ref, kv_ref)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def reference_f32(model: LlamaForCausalLM, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                  kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The module path with every quantised linear run as F.linear on its dequantised weight and torch's SwiGLU."""
    with mock.patch.object(QuantLinear, "forward", lambda self, x: F.linear(x, self.packed.dequantise(), self.bias)), \
            mock.patch.object(decoder_bf16, "silu_mul", decoder_bf16.silu_mul_reference):
        return module_path(model, ids, pos, meta, kv)


@needs_f32
def test_f32_stack_needs_every_linear_quantised():
    model = tiny_model(dtype=torch.float32, inter=192)
    quantise(model, "u4", ("qkv_proj", "o_proj", "gate_up_proj"))            # down_proj: fp32 panels
    pos, meta = step([40], [1], {})
    with torch.inference_mode():
        model(torch.tensor([7]), pos, meta, caches(model, 3))
    assert model._stack[1] is None


@needs_f32
def test_f32_silu_mul_matches_torch():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(7, 2 * 53, generator=g) * torch.tensor([0.01, 1.0, 8.0, 40.0, 100.0, 0.3, 3.0])[:, None]
    gu[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 88.5, -88.5])
    got, want = decoder_bf16.silu_mul(gu), decoder_bf16.silu_mul_reference(gu)
    assert got.shape == (7, 53)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-37)        # the exps may differ in the last bit
    assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_residual_adds_fused_into_the_norms_equal_the_adds_then_the_norms(dtype):
    """A prompt chunk through the modules, each layer's residual adds done by the norm after them (in C where it
    runs), against the adds and norms one by one."""
    model = tiny_model(dtype=dtype)
    kv_fused, kv_plain = caches(model, 1), caches(model, 1)
    pos, meta = step([300], [200], {})
    ids = torch.randint(0, 300, (len(pos),), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model(ids, pos, meta, kv_fused)
        x = model.embed_tokens(ids)
        cos, sin = model.rope_cos[pos].to(dtype), model.rope_sin[pos].to(dtype)
        for layer, kv in zip(model.layers, kv_plain):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, meta, kv)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        want = model.norm(x)
    assert torch.equal(got, want)

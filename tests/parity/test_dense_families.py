"""Dense families beside Llama: tiny random Qwen2, Qwen3, Mistral, Phi-3 and Gemma checkpoints made with
transformers' own config classes and `save_pretrained`, against transformers in fp32 (teacher-forced logits,
greedy tokens, n-gram speculation), sliding windows included."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine
from shared.testing.gguf_files import write_gguf
from shared.testing.dense_checkpoints import (GEMMA, MAKERS, PROMPTS, make_gemma2, make_gemma3, make_llama3,
                                              make_mistral, make_phi3, make_qwen2, make_qwen3, save_dense)
from shared.testing.moe_checkpoints import COMMON, hf_greedy

@pytest.mark.parametrize("family", list(MAKERS))
def test_logits_greedy_and_speculation_match_transformers(tmp_path, family):
    ref = save_dense(MAKERS[family], tmp_path)
    if family == "qwen2":
        assert ref.model.layers[0].self_attn.q_proj.bias is not None          # the biases are loaded and used
    if family in ("phi3_longrope", "phi4_mini"):   # 120 positions scored: all on the long factors, as in transformers
        assert eng_long_rope(tmp_path) == 32
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16,
                                 max_model_len=128))
    if family == "phi4_mini":               # a partial rotary factor: 16 of each head's 32 dims rotated
        assert eng.model_cfg.rotary_dim == 16 and eng.runner.model.rope_cos.shape[-1] == 16
    ids = torch.randint(1, 110, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    diff = (eng.score(ids) - expect).abs().max().item()
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff < 1e-4
    want = hf_greedy(ref, PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == want
    spec = build_engine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16,
                                     speculative="ngram", num_speculative_tokens=3, max_model_len=128))
    assert [o[0] for o in spec.generate(PROMPTS, params)] == want
    assert spec.stats_draft > 0                                             # prompt lookup did propose


def eng_long_rope(path) -> int | None:
    return LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64)).runner.model.long_rope_after


def test_longrope_past_the_original_window_matches_transformers(tmp_path):
    """Phi-3's LongRoPE with an original window of 32: prompts under it whose outputs cross it (transformers moves
    each later token to the long factors), a prompt over it (all on the long factors), one that ends exactly at it,
    greedy and with n-gram speculation (verification rows across the switch). A prompt's blocks computed with one
    set of factors are not reused for a prompt on the other (same tokens, 33 against 20 of them)."""
    ref = save_dense(lambda: make_phi3(None, True), tmp_path)
    ids = torch.randint(1, 110, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = PROMPTS + [ids, ids[:32], ids[:20], ids[:33]]
    want = hf_greedy(ref, prompts, tokens=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16))
    assert eng.runner.model.long_rope_after == 32
    got = [o[0] for p in prompts for o in eng.generate([p], params)]   # one at a time: the cache serves later ones
    assert got == want
    spec = build_engine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16,
                                     speculative="ngram", num_speculative_tokens=3))
    assert [o[0] for o in spec.generate(prompts, params)] == want
    assert spec.stats_draft > 0


def _qwen2_windowed():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, intermediate_size=96, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_past_the_window_matches_transformers(tmp_path, family):
    """Mistral with a 16-token window on every layer and Qwen2 with an 8-token one on its layers from
    max_window_layers on; prompts and outputs run far past the window (up to 90 positions)."""
    make = (lambda: make_mistral(16)) if family == "mistral" else _qwen2_windowed
    ref = save_dense(make, tmp_path)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16))
    windows = [layer.self_attn.window for layer in eng.runner.model.layers]
    assert windows == ([16, 16, 16] if family == "mistral" else [None, 8, 8])
    ids = torch.randint(1, 110, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    diff = (eng.score(ids) - expect).abs().max().item()
    assert diff < 1e-4, f"max |logits - transformers| = {diff:.2e}"
    prompts = PROMPTS + [ids[:40]]
    want = hf_greedy(ref, prompts)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert [o[0] for o in eng.generate(prompts, params)] == want
    spec = build_engine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16,
                                     speculative="ngram", num_speculative_tokens=3))
    assert [o[0] for o in spec.generate(prompts, params)] == want
    assert spec.stats_draft > 0


def test_blocks_behind_the_window_go_back_to_the_pool(tmp_path):
    """Mistral with a 16-token window on every layer, blocks of 16: a sequence holds at most the blocks its window
    spans (plus the one being filled) however long it grows, and the output still equals transformers'."""
    ref = save_dense(lambda: make_mistral(16), tmp_path)
    eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=16))
    assert eng.window == 16
    used, step = [], eng.step

    def counted():
        out = step()
        used.append(eng.block_manager.num_used_blocks)
        return out
    eng.step = counted
    prompt = torch.randint(1, 110, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    assert out[0][0] == hf_greedy(ref, [prompt], 120)[0]
    assert max(used[1:]) <= 3 and used[0] <= 3, used          # 190 positions, never more than 3 blocks held
    assert eng.block_manager.num_used_blocks == 0                   # and every block came back at the end


def test_mistral_without_a_window(tmp_path):
    ref = save_dense(lambda: make_mistral(None), tmp_path / "full")                 # Mistral v0.2+: no window
    eng = LLMEngine(EngineConfig(model=str(tmp_path / "full"), progress=False, num_kv_blocks=64))
    out = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o[0] for o in out] == hf_greedy(ref, PROMPTS)
    windowed = LLMEngine(EngineConfig(model=str(tmp_path / "full"), progress=False, num_kv_blocks=64,
                                      hf_overrides={"sliding_window": 16}))   # a folder's config.json, overridden
    assert [layer.self_attn.window for layer in windowed.runner.model.layers] == [16] * 3


def test_a_mistral_gguf_file_takes_its_window_from_hf_overrides(tmp_path):
    """Mistral 7B v0.1's GGUF files are written as llama.cpp's `llama`, without the 4096-token window: served as
    they are, they attend to everything. `hf_overrides` (--hf-overrides '{"sliding_window": 16}' on target and
    serve) puts the window back, and the file then matches transformers' Mistral past its window."""
    torch.manual_seed(0)
    ref = make_mistral(16).eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(8)
    path = tmp_path / "mistral.gguf"
    write_gguf(ref, "llama", path)
    plain = LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, block_size=16))
    assert [layer.self_attn.window for layer in plain.runner.model.layers] == [None] * 3
    eng = LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, block_size=16,
                                 hf_overrides={"sliding_window": 16}))
    assert [layer.self_attn.window for layer in eng.runner.model.layers] == [16] * 3
    ids = torch.randint(1, 110, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    assert (plain.score(ids) - expect).abs().max().item() > 1e-2          # full attention differs past 16
    assert_matches(eng, ref, 24)


def test_an_eagle_head_for_a_partial_rotary_target(tmp_path):
    """A head shaped for a Phi-4-mini-like target (head_config_for) rotates the dims its target rotates (half of
    each head here), also once saved and loaded; its trees, verified in process, give transformers' greedy tokens."""
    from shared.model.loader import load_config
    from shared.spec.eagle import EagleHead, head_config_for
    ref = save_dense(MAKERS["phi4_mini"], tmp_path / "target")
    cfg = load_config(str(tmp_path / "target"))
    torch.manual_seed(0)
    head = EagleHead(head_config_for(cfg, 64))
    assert head.rope_cos.shape[-1] == cfg.rotary_dim == cfg.head_dim // 2
    head.save(str(tmp_path / "head"))
    assert EagleHead.load(str(tmp_path / "head"), torch.float32, torch.device("cpu")).rope_cos.shape[-1] == 16
    eng = build_engine(EngineConfig(model=str(tmp_path / "target"), progress=False, num_kv_blocks=64, block_size=16,
                                    speculative=f"eagle:{tmp_path / 'head'}", num_speculative_tokens=3,
                                    draft_confidence=0.0, draft_tree_nodes=6))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == hf_greedy(ref, PROMPTS, 24)
    assert eng.stats_draft > 0


def test_an_unknown_family_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2' is not supported; the supported families are .*qwen3"):
        LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=8))


def assert_matches(eng: LLMEngine, ref, tokens: int) -> None:
    """The engine against transformers' `ref`: teacher-forced logits of a 60-token prompt within 1e-4, and
    `tokens` greedy tokens of each of PROMPTS equal."""
    ids = torch.randint(1, 110, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expect = ref(torch.tensor([ids])).logits[0]
    assert (eng.score(ids) - expect).abs().max().item() < 1e-4
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    assert [o[0] for o in eng.generate(PROMPTS, params)] == hf_greedy(ref, PROMPTS, tokens)


GGUF_MAKERS = {"llama": make_llama3, "qwen2": make_qwen2, "qwen3": make_qwen3, "phi3": make_phi3,
               # as every Gemma 2: tied embeddings, and query_pre_attn_scalar = head dim (a GGUF file does not carry
               # it; llama.cpp takes the head dim, but for the 27B)
               "gemma2": lambda: make_gemma2(query_pre_attn_scalar=GEMMA["head_dim"], tie_word_embeddings=True),
               # Gemma 3 as llama.cpp reads it: every 6th layer global, the local RoPE base 10000
               "gemma3": lambda: make_gemma3(10000.0, query_pre_attn_scalar=GEMMA["head_dim"], tie_word_embeddings=True,
                                         num_hidden_layers=6, layer_types=None),
               # the 128k variants: LongRoPE factors as rope_factors_long / _short tensors, the original window (32
               # here) and attention factor in the metadata; Phi-4-mini's rope.dimension_count is its rotated dims
               "phi3_longrope": lambda: make_phi3(None, True), "phi4_mini": lambda: make_phi3(None, True, 0.5)}
GGUF_ARCH = {"phi3_longrope": "phi3", "phi4_mini": "phi3"}             # the file's architecture, where not the key


@pytest.mark.parametrize("family", list(GGUF_MAKERS))
def test_gguf_files_match_transformers(tmp_path, family):
    """Llama 3 (q/k rows permuted for llama.cpp, its RoPE scaling as a rope_freqs tensor), Qwen2 (q/k/v biases),
    Qwen3 (q/k norms, its own head_dim), Phi-3 (fused qkv and gate-up, a 16-token window
    on every layer) and Gemma 2 (norms stored as 1 + w, four a layer, alternating 12-token windows, soft caps)
    and Gemma 3 (its q/k norms stored as 1 + w too, every 6th layer global with linear RoPE scaling, the local
    layers on their own base) written as GGUF with gguf's tensor names (q/k rows unpermuted, as llama.cpp's
    converter leaves them), loaded and run against the model they came from; the 60-token prompt crosses every
    window. Phi-3's LongRoPE (factor tensors) and Phi-4-mini's partial rotary, past a 32-position window."""
    torch.manual_seed(0)
    ref = GGUF_MAKERS[family]().eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(8)
    path = tmp_path / f"{family}.gguf"
    arch = GGUF_ARCH.get(family, family)
    write_gguf(ref, arch, path)
    eng = LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, block_size=16))
    assert eng.model_cfg.architecture == {"gemma3": "gemma3_text"}.get(arch, arch)
    if arch == "phi3":
        c = eng.model_cfg
        assert (eng.long_rope_after, c.head_dim, c.rotary_dim) == {"phi3": (None, 16, 16), "phi4_mini": (32, 32, 16),
                                                                   "phi3_longrope": (32, 16, 16)}[family]
    assert_matches(eng, ref, 24)


def _dequantised_reference(src, precisions: dict[str, str]):
    """transformers' model of `src` with every weight `upesi quantize` made NVFP4 replaced by its dequantised
    value, computed here with shared.quant.nvfp4 (Phi-3's fused qkv / gate_up: each projection on its own
    scales), the embedding and LM head rounded to bf16."""
    from shared.quant.nvfp4 import quantise_weight
    c = src.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    state = {k: v.clone() for k, v in src.state_dict().items()}
    for key, w in state.items():
        if key.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            parts = w.split([q, kv, kv]) if "qkv" in key else w.chunk(2)
            state[key] = torch.cat([quantise_weight(t).dequantise() for t in parts])
        elif precisions.get(key.removesuffix(".weight")) == "nvfp4":
            state[key] = quantise_weight(w).dequantise()
        elif precisions.get(key.removesuffix(".weight")) == "bf16":
            state[key] = w.bfloat16().float()
    ref = type(src)(c).eval()
    ref.load_state_dict(state)
    return ref


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi4_mini", "gemma2"])
def test_nvfp4_checkpoints_of_the_families_match_the_dequantised_reference(tmp_path, family):
    """`upesi quantize` on Qwen2 (biases), Qwen3 (q/k norms), a Phi-4-mini-like model (fused qkv and gate_up in the
    checkpoint, partial rotary, LongRoPE) and Gemma 2: every linear layer NVFP4, served in fp32 against transformers
    on the dequantised weights."""
    from shared.convert.quantize import quantize
    from shared.quant.nvfp4_module import NVFP4Linear
    src = save_dense(MAKERS[family], tmp_path / "src")
    result = quantize(str(tmp_path / "src"), str(tmp_path / "q"), progress=False)
    eng = LLMEngine(EngineConfig(model=str(tmp_path / "q"), progress=False, num_kv_blocks=64, device="cpu"))
    layer = eng.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, NVFP4Linear) and isinstance(layer.mlp.gate_up_proj, NVFP4Linear)
    ref = _dequantised_reference(src, result.layer_precisions)
    assert_matches(eng, ref, 16)


@pytest.mark.parametrize("family", list(GGUF_MAKERS))
def test_quantised_gguf_files_are_served_packed(tmp_path, family):
    """The same files with their linear layers in Q4_0 / Q4_1 / Q8_0 (as llama.cpp's quantiser writes them), served
    with the layers packed (shared/quant/gguf_packing.py: biases, fused q/k/v of three types, Phi-3's fused
    tensors, tied heads), against transformers running the file's dequantised weights in fp32."""
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from shared.ops import qgemm
    from shared.quant.quant_linear import QuantLinear
    if not qgemm.available():
        pytest.skip("needs the quantised kernel (AVX512-BF16)")
    torch.manual_seed(0)
    ref = GGUF_MAKERS[family]().eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(8)
    kinds = {"q_proj": T.Q4_0, "k_proj": T.Q4_1, "v_proj": T.Q8_0, "o_proj": T.Q4_1, "gate_proj": T.Q4_0,
             "up_proj": T.Q4_1, "down_proj": T.Q8_0, "qkv_proj": T.Q4_1, "gate_up_proj": T.Q4_0}
    shapes = {n: m.weight.shape for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}

    def quant(name: str):                                   # a linear's name -> its type (K a multiple of 32)
        kind = kinds.get(name.rsplit(".", 1)[-1])
        return kind if kind is not None and name in shapes and shapes[name][1] % 32 == 0 else None

    path = tmp_path / f"{family}-q.gguf"
    write_gguf(ref, GGUF_ARCH.get(family, family), path, quant=quant)
    with torch.no_grad():                                   # what the file holds, as transformers runs it
        for name, p in ref.named_parameters():
            kind = quant(name.removesuffix(".weight")) if name.endswith(".weight") and p.ndim == 2 else None
            if kind is not None:
                p.copy_(torch.from_numpy(dequantize(quantize(p.detach().numpy(), kind), kind)).view_as(p))
    eng = LLMEngine(EngineConfig(model=str(path), progress=False, num_kv_blocks=64, block_size=16))
    assert any(isinstance(m, QuantLinear) for m in eng.runner.model.modules())
    assert_matches(eng, ref, 24)

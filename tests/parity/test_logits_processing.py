"""Penalties, logit_bias, min_tokens, stop_token_ids, bad_words, min_p and log-probabilities against a reference
greedy loop over transformers' logits written here (one token at a time, in float64), with and without
speculation."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine
from shared.testing.reference_sampling import processed_greedy
from shared.testing.tiny_llama import PROMPTS

EOS = 95                                                    # the tiny model's
STEPS = 24


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> str:
    """The tiny Llama with its head scaled down (untied), so that penalties of a few units change its choices."""
    from shared.testing.tiny_llama import save_tiny
    path = tmp_path_factory.mktemp("flat-llama")
    model = save_tiny(path, None, tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.125)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf(flat):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(flat, torch_dtype=torch.float32).eval()


def next_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    return logits.double().clone()


def reference(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    """The params' processing over transformers' logits, greedy; EOS and stop_token_ids end the output."""
    stops = ({EOS} if not p.ignore_eos else set()) | set(p.stop_token_ids)
    return processed_greedy(lambda ids: next_logits(hf, ids), prompt, p.max_tokens, p.logit_bias, p.presence_penalty,
                            p.frequency_penalty, p.repetition_penalty, p.min_tokens, stops, p.bad_words)


CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.9),
    "repetition": dict(repetition_penalty=1.8),
    "negative": dict(presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.7),
    "logit_bias": dict(logit_bias={7: 6.0, 11: -100.0, 40: 2.5}),
    "all": dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias={3: 3.0}),
}


def first_tokens(hf, prompt: list[int], n: int) -> list[int]:
    return reference(hf, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("spec", [None, "ngram", "draft-model"])
@pytest.mark.parametrize("case", list(CASES))
def test_processing_equals_reference_loop(flat, hf, case: str, spec: str | None) -> None:
    """Greedy output equals the reference loop, plain and speculative (the draft proposes without penalties, so
    the verifier rejects what they change and must roll back exactly)."""
    eng = build_engine(EngineConfig(model=flat, progress=False, num_kv_blocks=128, block_size=4,
                                    speculative={None: None, "ngram": "ngram"}.get(spec, f"draft-model:{flat}"),
                                    num_speculative_tokens=3))
    p = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **CASES[case])
    prompts = PROMPTS[:4]
    got = [o[0] for o in eng.generate(prompts, p)]
    assert got == [reference(hf, pr, p) for pr in prompts]
    plain = [first_tokens(hf, pr, STEPS) for pr in prompts]
    assert got != plain                                     # the processing changed something
    if spec:
        assert eng.stats_draft > 0
    assert eng.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("spec", [None, "ngram", "draft-model"])
def test_bad_words_are_never_completed(flat, hf, spec: str | None) -> None:
    """Token sequences of one, two and three tokens taken from each prompt's plain output: the output equals the
    reference loop's and never holds one of them, plain and speculative."""
    eng = build_engine(EngineConfig(model=flat, progress=False, num_kv_blocks=128, block_size=4,
                                    speculative={None: None, "ngram": "ngram"}.get(spec, f"draft-model:{flat}"),
                                    num_speculative_tokens=3))
    for prompt in PROMPTS[:3]:
        plain = first_tokens(hf, prompt, STEPS)
        bad = [plain[2:3], plain[5:7], plain[9:12]]
        p = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, bad_words=bad)
        got = eng.generate([prompt], p)[0][0]
        assert got == reference(hf, prompt, p) and got != plain
        for w in bad:
            assert not any(got[i:i + len(w)] == w for i in range(len(got)))
    assert eng.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("spec", [None, "draft-model"])
def test_min_tokens_and_stop_token_ids(flat, hf, spec: str | None) -> None:
    """stop_token_ids end the output (the stop token included), min_tokens holds them and EOS back."""
    eng = build_engine(EngineConfig(model=flat, progress=False, num_kv_blocks=128, block_size=4,
                                    speculative=None if spec is None else f"draft-model:{flat}",
                                    num_speculative_tokens=3))
    prompt = PROMPTS[1]
    plain = first_tokens(hf, prompt, STEPS)
    stop = plain[2]                                         # a token the plain output reaches early
    p = SamplingParams(temperature=0, max_tokens=STEPS, stop_token_ids=[stop])
    got = eng.generate([prompt], p)[0][0]
    assert got == reference(hf, prompt, p) and got[-1] == stop and len(got) <= 3
    held = SamplingParams(temperature=0, max_tokens=STEPS, stop_token_ids=[stop], min_tokens=12)
    got = eng.generate([prompt], held)[0][0]
    assert got == reference(hf, prompt, held) and len(got) >= 12 and stop not in got[:12]


def test_min_p_one_keeps_only_the_most_likely(flat, hf) -> None:
    """min_p = 1 keeps only the tokens as likely as the most likely one: sampling then equals greedy."""
    eng = build_engine(EngineConfig(model=flat, progress=False, num_kv_blocks=128, block_size=4))
    p = SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=STEPS, ignore_eos=True)
    assert eng.generate(PROMPTS[:3], p) == [[first_tokens(hf, pr, STEPS)] for pr in PROMPTS[:3]]


def collect(eng, prompt: list[int], p: SamplingParams) -> tuple[list[int], list]:
    eng.add_request("lp", prompt, p)
    tokens, lps = [], []
    while eng.has_unfinished():
        for d in eng.step():
            tokens += d.token_ids
            lps += d.logprobs
    return tokens, lps


@pytest.mark.parametrize("spec", [None, "draft-model"])
def test_logprobs_equal_log_softmax(flat, hf, spec: str | None) -> None:
    """Each token's log-probability and the top 5 equal transformers' log-softmax of the raw logits (fp32: within
    1e-4), with penalties changing the choice but not the reported raw log-probabilities."""
    eng = build_engine(EngineConfig(model=flat, progress=False, num_kv_blocks=128, block_size=4,
                                    speculative=None if spec is None else f"draft-model:{flat}",
                                    num_speculative_tokens=3))
    prompt = PROMPTS[2]
    p = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5, presence_penalty=0.5)
    tokens, lps = collect(eng, prompt, p)
    assert tokens == reference(hf, prompt, p) and len(lps) == len(tokens)
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        ref = next_logits(hf, prompt + tokens[:i]).log_softmax(-1)
        assert abs(lp.logprob - ref[tok].item()) < 1e-4
        vals, idx = ref.topk(5)
        assert lp.top_ids == idx.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, vals.tolist())) < 1e-4
    _, chosen_only = collect(eng, prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    assert len(chosen_only) == 4 and all(not lp.top_ids for lp in chosen_only)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_equal_log_softmax(flat, hf, chunk: int | None) -> None:
    """Each prompt token after the first: its log-probability and the top 3 under transformers' logits, with the
    prompt computed in one pass or in chunks of 8, for both of n = 2 choices, and again when the same prompt's
    blocks are cached (those rows are computed anyway)."""
    eng = build_engine(EngineConfig(model=flat, progress=False, num_kv_blocks=128, block_size=4,
                                    **({"max_num_batched_tokens": chunk} if chunk else {})))
    prompt = PROMPTS[5]                                     # 40 tokens
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)      # [P, V]
    for _ in range(2):
        eng.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=3))
        got: dict[int, list] = {}
        while eng.has_unfinished():
            for d in eng.step():
                if d.prompt_logprobs is not None:
                    got[d.index] = d.prompt_logprobs
        assert set(got) == {0, 1}
        for lps in got.values():
            assert len(lps) == len(prompt) - 1
            for p, lp in enumerate(lps):
                assert abs(lp.logprob - ref[p, prompt[p + 1]].item()) < 1e-4
                assert lp.top_ids == ref[p].topk(3).indices.tolist()

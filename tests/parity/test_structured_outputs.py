"""Structured outputs in the engine against a reference greedy loop written here: transformers' fp32 logits of the
default model, masked by an xgrammar matcher of the test's own, one token at a time; plain and speculative."""
from __future__ import annotations

import json
import re

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CASES = [("json_schema", json.dumps(SCHEMA)), ("json_object", ""), ("regex", r"(19|20)[0-9]{2}-[0-9]{2}"),
         ("choice", json.dumps(["red", "green", "blue"])), ("grammar", 'root ::= "x" [0-9] [0-9] ("!" | "?")')]


@pytest.fixture(scope="module")
def xgr_compiler(hf_tokenizer, hf_model):
    import xgrammar as xgr
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf_tokenizer,
                                                                  vocab_size=hf_model.config.vocab_size))


def compiled(c, kind: str, spec: str):
    return {"json_schema": lambda: c.compile_json_schema(spec), "json_object": c.compile_builtin_json_grammar,
            "regex": lambda: c.compile_regex(spec),
            "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in json.loads(spec))),
            "grammar": lambda: c.compile_grammar(spec)}[kind]()


def reference(hf_model, compiler, prompt: list[int], kind: str, spec: str, steps: int, eos: int) -> list[int]:
    import xgrammar as xgr
    m = xgr.GrammarMatcher(compiled(compiler, kind, spec))
    mask = xgr.allocate_token_bitmask(1, hf_model.config.vocab_size)
    ids, out = list(prompt), []
    while len(out) < steps:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0, -1:].float()
        logits = logits.clone()
        m.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        tok = int(logits[0].argmax())
        assert m.accept_token(tok)
        out.append(tok)
        ids.append(tok)
        if tok == eos or m.is_terminated():
            break
    return out


@pytest.fixture(scope="module")
def engines():
    plain = build_engine(EngineConfig(progress=False, kv_cache_gb=0.1, dtype="float32"))
    spec = build_engine(EngineConfig(progress=False, kv_cache_gb=0.1, dtype="float32", speculative="ngram",
                                     num_speculative_tokens=4))
    return {"plain": plain, "ngram": spec}


@pytest.mark.parametrize("kind, spec", CASES, ids=[c[0] for c in CASES])
def test_guided_greedy_equals_the_masked_reference(engines, hf_model, hf_tokenizer, xgr_compiler, chat_prompt_ids,
                                                   kind, spec):
    prompt = chat_prompt_ids[0]
    want = reference(hf_model, xgr_compiler, prompt, kind, spec, 40, hf_tokenizer.eos_token_id)
    text = hf_tokenizer.decode(want, skip_special_tokens=True)
    if kind in ("json_schema", "json_object") and len(want) < 40:
        value = json.loads(text)
        assert kind == "json_object" or set(value) == {"name", "age", "tags"}
    if kind == "regex":
        assert re.fullmatch(spec, text)
    if kind == "choice":
        assert text in json.loads(spec)
    for name, eng in engines.items():
        p = SamplingParams(temperature=0, max_tokens=40, guide_kind=kind, guide=spec)
        assert eng.generate([prompt], p)[0][0] == want, name
        assert eng.block_manager.num_used_blocks == 0


def test_speculation_drafts_under_a_grammar(engines, chat_prompt_ids):
    eng = engines["ngram"]
    before = eng.stats_draft
    eng.generate([chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=60, guide_kind="json_schema",
                                                      guide=json.dumps(SCHEMA)))
    assert eng.stats_draft > before


def test_sampled_output_follows_the_grammar(engines, chat_prompt_ids, hf_tokenizer):
    for name, eng in engines.items():
        outs = eng.generate([chat_prompt_ids[2]] * 3, SamplingParams(temperature=1.0, seed=5, max_tokens=12,
                                                                     guide_kind="regex", guide="[A-Z][a-z]{2,8}"))
        for o in outs:
            assert re.fullmatch("[A-Z][a-z]{2,8}", hf_tokenizer.decode(o[0], skip_special_tokens=True)), name


@pytest.mark.parametrize("kind, spec, words", [("json_schema", "{not json", "does not compile"),
                                               ("regex", "(unclosed", "does not compile"),
                                               ("grammar", "root ::= ", "does not compile")])
def test_bad_grammars_are_refused(engines, chat_prompt_ids, kind, spec, words):
    eng = engines["plain"]
    with pytest.raises(InvalidRequest, match=words):
        eng.add_request("bad", chat_prompt_ids[0], SamplingParams(max_tokens=4, guide_kind=kind, guide=spec))
    assert "bad" not in eng.requests


def test_a_batch_of_different_grammars(engines, hf_model, hf_tokenizer, xgr_compiler, chat_prompt_ids):
    """Rows of one step masked each by its own grammar, in its own state (one batched fill)."""
    cases = [CASES[2], CASES[0], (None, None), CASES[3]]
    prompts = [chat_prompt_ids[i % len(chat_prompt_ids)] for i in range(len(cases))]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=kind is None, guide_kind=kind or "",
                             guide=spec or "") for kind, spec in cases]
    want = [reference(hf_model, xgr_compiler, p, kind, spec, 30, hf_tokenizer.eos_token_id) if kind else None
            for p, (kind, spec) in zip(prompts, cases)]
    for name, eng in engines.items():
        got = [o[0] for o in eng.generate(prompts, params)]
        for g, w in zip(got, want):
            assert w is None or g == w, name


@pytest.mark.parametrize("text", ["Paris is lovely in the spring", "Paris is lovely"])
def test_a_grammar_ending_inside_a_verification(engines, hf_tokenizer, text):
    """n-gram drafts that reach the grammar's end, as the prompt has the text: the last draft before its stop token
    (the stop token then follows the accepted drafts), or the stop token and more text after it (the verification
    ends at the stop token instead of asking the finished grammar for another mask). The answer is the plain one,
    whole."""
    eos = hf_tokenizer.eos_token_id
    words = hf_tokenizer.encode(text, add_special_tokens=False)
    prompt = words + [eos] + hf_tokenizer.encode(" and the summer too, they say", add_special_tokens=False) + words
    p = SamplingParams(temperature=0, max_tokens=20, guide_kind="regex", guide=text)
    want = engines["plain"].generate([prompt], p)[0][0]
    assert hf_tokenizer.decode(want, skip_special_tokens=True) == text
    eng = engines["ngram"]
    before = eng.stats_draft
    assert eng.generate([prompt], p)[0][0] == want
    assert eng.stats_draft > before
    assert eng.block_manager.num_used_blocks == 0

"""Log-probabilities and sampling controls through the OpenAI API of a running stack (fp32, a draft service
proposing n-gram drafts), with the official openai client, against transformers' fp32 logits of the default model
and a reference greedy loop written here."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from shared.testing.reference_sampling import processed_greedy
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": CHAT_PROMPTS[1]}]


@pytest.fixture(scope="module")
def prompt_ids(chat_prompt_ids) -> list[int]:
    return chat_prompt_ids[1]


def logits_after(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    return logits.double().clone()                      # outside inference mode: a tensor the loop may change


def reference(hf_model, prompt: list[int], steps: int, **kw) -> list[int]:
    """Greedy, one full forward a token (shared.testing.reference_sampling)."""
    return processed_greedy(lambda ids: logits_after(hf_model, ids), prompt, steps, **kw)


def chat(oai, **kw):
    return oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0, **kw)


def test_chat_logprobs_equal_transformers(oai, hf_model, hf_tokenizer, prompt_ids):
    r = chat(oai, max_tokens=10, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 10 and "".join(c.token for c in content) == r.choices[0].message.content
    generated = []
    for c in content:
        ref = logits_after(hf_model, prompt_ids + generated).log_softmax(-1)
        top = ref.topk(3)
        assert [t.token for t in c.top_logprobs] == [hf_tokenizer.decode([i]) for i in top.indices.tolist()]
        for got, want in zip(c.top_logprobs, top.values.tolist()):
            assert abs(got.logprob - want) < 0.02
        tok = int(top.indices[0])                       # greedy: the top token is the one generated
        assert c.token == hf_tokenizer.decode([tok]) and abs(c.logprob - ref[tok].item()) < 0.02
        assert c.bytes == list(c.token.encode())
        generated.append(tok)


def test_streamed_logprobs_reassemble(oai):
    whole = chat(oai, max_tokens=8, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    parts = []
    for chunk in chat(oai, max_tokens=8, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            parts += chunk.choices[0].logprobs.content
    assert [(p.token, round(p.logprob, 5)) for p in parts] == [(w.token, round(w.logprob, 5)) for w in whole]


def test_completion_logprobs_shape(oai):
    r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=6,
                               temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert x <= 0 and top[tok] == x and len(top) >= 2


@pytest.mark.parametrize("kw, ref", [
    ({"frequency_penalty": 1.2}, {"frequency": 1.2}),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.3}, {"presence": 1.5, "frequency": 0.3}),
    ({"extra_body": {"repetition_penalty": 1.6}}, {"repetition": 1.6}),
    ({"logit_bias": {"504": 8, "28": -100}}, {"bias": {504: 8.0, 28: -100.0}}),
])
def test_penalties_and_bias_equal_the_reference_loop(oai, hf_model, hf_tokenizer, prompt_ids, kw, ref):
    r = chat(oai, max_tokens=16, **kw)
    want = reference(hf_model, prompt_ids, 16, **ref)
    eos = hf_tokenizer.eos_token_id
    want = want[:want.index(eos)] if eos in want else want
    assert r.choices[0].message.content == hf_tokenizer.decode(want, skip_special_tokens=True)
    plain = reference(hf_model, prompt_ids, 16)
    assert want != plain[:len(want)]                    # the request changed the output


def test_min_tokens_and_stop_token_ids(oai, hf_model, hf_tokenizer, prompt_ids):
    plain = reference(hf_model, prompt_ids, 12)
    stop = plain[3]
    r = chat(oai, max_tokens=12, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 4
    r = chat(oai, max_tokens=12, extra_body={"stop_token_ids": [stop], "min_tokens": 8, "ignore_eos": True})
    want = reference(hf_model, prompt_ids, 12, min_tokens=8, stops={stop})
    assert r.usage.completion_tokens == len(want) >= 8 and stop not in want[:8]
    assert r.choices[0].message.content == hf_tokenizer.decode(want, skip_special_tokens=True)


def test_bad_words_equal_the_reference_loop(oai, hf_model, hf_tokenizer, prompt_ids):
    """A word of the plain answer, given as bad_words: its tokens with and without a leading space are never
    completed (vLLM's reading), as in the reference loop; the answer changes and no longer holds the word."""
    plain = chat(oai, max_tokens=16).choices[0].message.content
    word = next(w for w in plain.split() if w.isalpha() and len(w) > 3)
    bad = [hf_tokenizer.encode(v, add_special_tokens=False) for v in (word, " " + word)]
    r = chat(oai, max_tokens=16, extra_body={"bad_words": [word]})
    want = reference(hf_model, prompt_ids, 16, bad=bad)
    eos = hf_tokenizer.eos_token_id
    want = want[:want.index(eos)] if eos in want else want
    assert r.choices[0].message.content == hf_tokenizer.decode(want, skip_special_tokens=True) != plain
    assert f" {word} " not in f" {r.choices[0].message.content} "


def test_stop_string_kept_and_special_tokens_written_where_asked(oai, hf_model, hf_tokenizer, prompt_ids):
    """include_stop_str_in_output keeps the stop string that ended the text; skip_special_tokens false writes the
    end-of-turn token of a short answer (ignore_eos goes on past it)."""
    text = chat(oai, max_tokens=12).choices[0].message.content
    stop = text.split()[2]
    for include in (False, True):
        r = chat(oai, max_tokens=12, stop=[stop], extra_body={"include_stop_str_in_output": include}).choices[0]
        assert r.finish_reason == "stop"
        assert r.message.content == text[:text.index(stop) + (len(stop) if include else 0)]
    short = [{"role": "user", "content": "What is 2 + 2? Answer with a number only."}]
    ids = hf_tokenizer.apply_chat_template(short, add_generation_prompt=True, tokenize=True)
    want = reference(hf_model, list(ids["input_ids"] if hasattr(ids, "keys") else ids), 12)
    assert hf_tokenizer.eos_token_id in want[:-2]                   # the answer ends, and more tokens follow
    for skip in (True, False):
        r = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=short, temperature=0, max_tokens=12,
                                        extra_body={"ignore_eos": True, "skip_special_tokens": skip}).choices[0]
        assert r.message.content == hf_tokenizer.decode(want, skip_special_tokens=skip)
        assert (hf_tokenizer.eos_token in r.message.content) is (not skip)


def post(stack, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("extra, status, words", [
    ({"frobnicate": 3}, 400, "frobnicate"),
    ({"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "user": "u"}, 200, ""),
    ({"top_logprobs": 2}, 400, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
    ({"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ({"min_tokens": 9}, 400, "min_tokens"),
    ({"stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"bad_words": [" "]}, 400, "bad_words"),
    ({"bad_words": "word"}, 400, "bad_words"),
    ({"guided_decoding_backend": "outlines"}, 400, "guided_decoding_backend"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, 200, ""),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, 400, "add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": "x"}}, 400, "tools"),
])
def test_fields_are_honoured_or_refused(spec_stack, extra, status, words):
    code, body = post(spec_stack, {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert code == status, body
    if status != 200:
        assert words in body["error"]["message"] and set(body["error"]) == {"message", "type", "param", "code"}


def test_grpc_carries_the_same_with_drafts_verified(spec_stack, oai, hf_model, prompt_ids):
    """The public gRPC API takes the same controls and returns the same tokens and log-probabilities, and the
    draft service's proposals were verified under the penalty (drafted tokens counted)."""
    import grpc

    from upesi.v1 import generation_pb2 as pb
    from upesi.v1 import generation_pb2_grpc
    with grpc.insecure_channel(spec_stack.address) as ch:
        r = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in MESSAGES], max_tokens=40, temperature=0, ignore_eos=True,
            frequency_penalty=0.4, num_speculative_tokens=4, logprobs=2), timeout=300)
    c = r.choices[0]
    assert list(c.token_ids) == reference(hf_model, prompt_ids, 40, frequency=0.4)
    assert len(c.logprobs) == len(c.token_ids) and all(len(lp.top_ids) == 2 for lp in c.logprobs)
    assert r.spec.draft_tokens > 0
    http = chat(oai, max_tokens=40, frequency_penalty=0.4, logprobs=True, extra_body={"ignore_eos": True})
    assert http.choices[0].message.content == c.text
    assert [round(x.logprob, 4) for x in http.choices[0].logprobs.content] == [round(lp.logprob, 4)
                                                                                for lp in c.logprobs]


def test_batched_and_token_id_prompts(oai, hf_tokenizer):
    """A list of prompts (text and token ids) answers each, choice p * n + j for prompt p, plain and streamed; a
    token-id prompt answers as its text does."""
    text = "The capital of France is"
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=5, temperature=0)
    one = oai.completions.create(prompt=text, **kw).choices[0].text
    r = oai.completions.create(prompt=[text, "Two plus two is", text], n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert r.choices[0].text == r.choices[1].text == r.choices[4].text == one != r.choices[2].text
    assert r.usage.prompt_tokens == 2 * len(ids) + len(hf_tokenizer("Two plus two is")["input_ids"])
    assert oai.completions.create(prompt=ids, **kw).choices[0].text == one
    assert oai.completions.create(prompt=[ids, ids], **kw).choices[1].text == one
    texts: dict[int, str] = {}
    for chunk in oai.completions.create(prompt=[text, ids], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: one, 1: one}


def test_tokenize_detokenize_and_model_card(spec_stack, hf_tokenizer, prompt_ids):
    def call(path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{spec_stack.http_port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    code, body = call("/tokenize", {"prompt": "Hello world, again."})
    want = hf_tokenizer("Hello world, again.", add_special_tokens=False)["input_ids"]
    assert code == 200 and body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] > 0
    code, chat = call("/tokenize", {"messages": MESSAGES})
    assert code == 200 and chat["tokens"] == prompt_ids
    assert call("/detokenize", {"tokens": want}) == (200, {"prompt": "Hello world, again."})
    assert call("/detokenize", {"tokens": [10**8]})[0] == 400
    assert call("/tokenize", {"prompt": "a", "messages": MESSAGES})[0] == 400
    assert call("/tokenize", {"prompt": "a", "frobnicate": 1})[0] == 400
    assert call("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": 1}})[0] == 400
    assert call("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}})[0] == 400
    with urllib.request.urlopen(f"http://127.0.0.1:{spec_stack.http_port}/v1/models", timeout=60) as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == body["max_model_len"]


def test_parse_returns_a_validated_object(oai):
    """The client's chat.completions.parse sends a strict json_schema response_format from a pydantic model."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        capital: bool

    r = oai.chat.completions.parse(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=80,
                                   messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                   response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), (dict, list))),
    ({"extra_body": {"guided_choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]{4}"}}}, lambda t: len(t) == 4 and t.isdigit()),
    ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, lambda t: t in ("yes", "no")),
    ({"extra_body": {"guided_grammar": 'root ::= "ok" [0-9]'}}, lambda t: t[:2] == "ok" and t[2:].isdigit()),
])
def test_structured_outputs_through_the_stack(oai, extra, check):
    r = chat(oai, max_tokens=60, **extra)
    assert check(r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "one structured output"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml"),
    ({"guided_choice": []}, "choice"),
])
def test_bad_structured_requests_are_400(spec_stack, extra, words):
    code, body = post(spec_stack, {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert code == 400 and words in body["error"]["message"], body


def test_echo_with_logprobs_scores_the_prompt(oai, hf_model, hf_tokenizer):
    """What lm-eval's loglikelihood requests send: echo, logprobs and one new token; each prompt token after the
    first carries its log-probability under transformers' fp32 logits (the prompt's own rows are computed even
    when its blocks are cached)."""
    text = "The capital of France is Paris, and the capital of Italy is"
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    for _ in range(2):
        r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=1, temperature=0,
                                   logprobs=1, echo=True)
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(text) and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 0.02
            assert max(lp.top_logprobs[p].values()) == pytest.approx(ref[p - 1].max().item(), abs=0.02)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=3, temperature=0,
                                   echo=True)
    assert plain.choices[0].text.startswith(text) and plain.choices[0].logprobs is None


def test_prompt_logprobs_in_vllms_form_for_completions_chat_and_grpc(oai, spec_stack, hf_model, hf_tokenizer):
    """vLLM's prompt_logprobs: None, then per prompt token {id: {logprob, rank, decoded_token}} for the token and the
    top N, under transformers' fp32 logits; in completions per choice, in chat beside the choices; over gRPC the
    same figures; refused with stream."""
    text = "The capital of France is Paris, and the capital of Italy is"
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)

    def check(entries: list, prompt: list[int]) -> None:
        assert entries[0] is None and len(entries) == len(prompt)
        for p in range(1, len(prompt)):
            row, tok = ref[p - 1], prompt[p]
            got = entries[p][str(tok)]
            assert abs(got["logprob"] - row[tok].item()) < 0.02
            assert got["decoded_token"] == hf_tokenizer.decode([tok])
            if ((row - row[tok]).abs() < 0.02).sum() == 1:             # no near tie: the rank is decided
                assert got["rank"] == 1 + int((row > row[tok]).sum())
            ranked = {v["rank"]: int(k) for k, v in entries[p].items()}
            assert {1, 2} <= set(ranked) and len(entries[p]) <= 3
            best = row.topk(2)
            if best.values[0] - best.values[1] > 0.02:
                assert ranked[1] == best.indices[0].item()
    r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=1, temperature=0,
                               extra_body={"prompt_logprobs": 2}).model_dump()
    assert r["choices"][0]["logprobs"] is None                         # no echo, no logprobs: only the prompt's
    check(r["choices"][0]["prompt_logprobs"], ids)
    c = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": text}],
                                    max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}).model_dump()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    code, body = post(spec_stack, {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
    assert code == 400 and "prompt_logprobs" in body["error"]["message"]
    import grpc

    from upesi.v1 import generation_pb2, generation_pb2_grpc
    with grpc.insecure_channel(spec_stack.address) as ch:
        g = generation_pb2_grpc.GenerationStub(ch).Generate(
            generation_pb2.GenerateRequest(prompt=text, max_tokens=1, temperature=0, prompt_logprobs=2), timeout=120)
    choice = g.choices[0]
    assert list(choice.prompt_token_ids) == ids and len(choice.prompt_logprobs) == len(ids) - 1
    for p, lp in enumerate(choice.prompt_logprobs, 1):
        assert abs(lp.logprob - ref[p - 1, ids[p]].item()) < 0.02 and lp.rank >= 1 and len(lp.top_ids) == 2


def test_reasoning_content_apart_plain_and_streamed(oai):
    """With --reasoning-parser think, a chat answer's <think>...</think> is reasoning_content (a regex forces the
    default model, which does not think, to answer in that shape)."""
    kw = dict(max_tokens=60, extra_body={"structured_outputs": {"regex": "<think>[a-z]{3,12}</think>[A-Z][a-z]{2,8}"}})
    r = chat(oai, **kw).choices[0].message.model_dump()
    assert r["reasoning_content"].isalpha() and r["content"][0].isupper() and "<think>" not in r["content"]
    reasoning = content = ""
    for chunk in chat(oai, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
    assert (reasoning, content) == (r["reasoning_content"], r["content"])
    plain = chat(oai, max_tokens=8).choices[0].message.model_dump()
    assert plain.get("reasoning_content") is None and plain["content"]

"""A thinking checkpoint through `upesi serve --reasoning-parser think`: a tiny Qwen3 (random weights) whose chat
template, as those of Qwen3's thinking models and DeepSeek-R1, ends the prompt inside `<think>` (the answer begins
with the reasoning and only closes the tag), or with an empty `<think> </think>` when `chat_template_kwargs` turns
thinking off. Regexes make the random model answer in those shapes; the parser must split what it generated."""
from __future__ import annotations

import json

import pytest

from shared.testing.stack import Stack

pytestmark = pytest.mark.slow
WORDS = ["why", "sky", "blue", "light", "yes", "no", "hello", "user", "assistant"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# thinking on (the default): the prompt ends inside <think>; off: an empty thought, closed
TEMPLATE = ("{%- for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor -%}"
            "{%- if add_generation_prompt %}<|im_start|> assistant <think> "
            "{%- if enable_thinking is defined and not enable_thinking %} </think>{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "why blue sky"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    path = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    vocab = {w: i for i, w in enumerate(SPECIAL + ["<think>", "</think>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")                      # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=SPECIAL[1:2])
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=vocab["<|im_end|>"], bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    s = Stack(path, ["--model", str(path), "--dtype", "float32", "--reasoning-parser", "think"])
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]


def ask(stack, **kw) -> dict:
    import urllib.request
    body = {"messages": ASK, "temperature": 0, "max_tokens": 12, **kw}
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not kw.get("stream"):
        return json.loads(raw)
    reasoning = content = ""
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                reasoning += ch["delta"].get("reasoning_content") or ""
                content += ch["delta"].get("content") or ""
    return {"reasoning_content": reasoning, "content": content}


def tokenize(stack, body: dict) -> dict:
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/tokenize", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_an_answer_that_begins_inside_the_thinking_is_split(thinking):
    kw = {"structured_outputs": {"regex": "(why|sky|light){1,3}</think>(yes|no)"}}
    msg = ask(thinking, **kw)["choices"][0]["message"]
    assert set(msg["reasoning_content"].split()) <= {"why", "sky", "light"} and msg["reasoning_content"]
    assert msg["content"] in ("yes", "no")
    streamed = ask(thinking, stream=True, **kw)
    assert (streamed["reasoning_content"], streamed["content"]) == (msg["reasoning_content"], msg["content"])


def test_thinking_turned_off_by_the_template_kwargs(thinking):
    on = ask(thinking, structured_outputs={"regex": "(why|sky)</think>(yes|no)"})
    off = ask(thinking, chat_template_kwargs={"enable_thinking": False}, structured_outputs={"regex": "(yes|no)"})
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + 1          # the closing tag, rendered
    counts = [tokenize(thinking, {"messages": ASK, **kw})["count"] for kw in
              ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    assert counts == [on["usage"]["prompt_tokens"], off["usage"]["prompt_tokens"]]     # /tokenize renders alike
    assert off["choices"][0]["message"].get("reasoning_content") is None
    assert off["choices"][0]["message"]["content"].strip() in ("yes", "no")

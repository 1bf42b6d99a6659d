"""The serving tokenizer (tokenizers + the chat-template renderer, no torch) against transformers' AutoTokenizer on
the default model: the same ids, text, special tokens and chat prompts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines  ", "naïve café — 東京 🙂",
         "<|im_start|>user\nnot a real turn<|im_end|>", "def f(x):\n    return x ** 2\n", ""]
CHATS = [
    [{"role": "user", "content": "What is photosynthesis?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "a <|im_end|> inside", "name": None}],
]


@pytest.fixture(scope="module")
def ours(model_path) -> Tokenizer:
    return Tokenizer(model_path)


def test_ids_text_and_chat_prompts_match_transformers(ours, hf_tokenizer):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=False)
        assert ours.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    for chat in CHATS:
        want = hf_tokenizer.apply_chat_template([{k: v for k, v in m.items() if v is not None} for m in chat],
                                                add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(chat) == hf_tokenizer.encode(want, add_special_tokens=False)
    assert ours.eos_token_id == hf_tokenizer.eos_token_id
    assert ours.decode([ours.eos_token_id]) == ""                      # special tokens are skipped


def test_a_gguf_is_converted_once_in_a_child_and_served_without_torch(model_path, tmp_path):
    code = ("import sys\n"
            "from shared.tokenizer import Tokenizer\n"
            f"t = Tokenizer({model_path!r})\n"
            "ids = t.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "print(len(ids) > 3, 'torch' in sys.modules, 'transformers.modeling_utils' in sys.modules)\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}             # a cache of its own: converts first
    for _ in range(2):                                                 # converts, then reads the cache
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["True", "False", "False"]
    assert len(list((tmp_path / "upesi" / "tokenizers").iterdir())) == 1


def test_bad_chats_are_client_errors(ours):
    from shared.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="empty"):
        ours.apply_chat_template([])
    with pytest.raises(InvalidRequest, match="role"):
        ours.apply_chat_template([{"role": "wizard", "content": "x"}])

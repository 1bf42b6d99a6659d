"""The draft's training prompts: the self-instruct filter and prefix, and that no benchmark prompt is trained on."""
from __future__ import annotations

from pathlib import Path

import pytest

from data.build_draft_prompts import BENCH
from data.self_instruct_prompts import keep, user_turn_prefix

DATA = Path(__file__).resolve().parents[2] / "data"


def test_filter_keeps_plain_requests_only() -> None:
    assert keep("Can you give me a recipe for a gluten-free bread?")
    assert not keep("Hi there")                                             # under 4 words
    assert not keep(" ".join(["word"] * 61))                                # over 60
    assert not keep("Please summarise https://example.com for me today")   # a link
    assert not keep("Напиши мне короткое стихотворение о весне пожалуйста")  # not printable ASCII
    assert not keep(next(iter(BENCH)))                                      # a benchmark prompt


@pytest.mark.parametrize("name", ["draft_prompts_large.txt", "draft_prompts_self.txt"])
def test_prompt_sets_leave_out_the_benchmark(name: str) -> None:
    lines = [line.strip() for line in (DATA / name).read_text().splitlines() if line.strip()]
    assert len(lines) >= 300
    assert len(set(lines)) == len(lines)
    assert not BENCH & set(lines)


def test_user_turn_prefix_is_the_template_up_to_the_message() -> None:
    from shared.model_files import default_model_path
    from shared.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Tell me about owls."}])
    assert full[:len(prefix)] == prefix
    assert tok.hf.decode(full[len(prefix):], skip_special_tokens=True).startswith("Tell me about owls.")
    assert tok.hf.decode(prefix[-3:], skip_special_tokens=False).endswith("user\n")


def test_train_draft_reads_several_prompt_files_each_prompt_once(tmp_path) -> None:
    from services.draft_data import read_prompts
    (tmp_path / "a.txt").write_text("What is rain?\n\nTell me a joke.\n")
    (tmp_path / "b.txt").write_text("  Tell me a joke.  \nName three rivers.\n")
    assert read_prompts(f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}") == [
        "What is rain?", "Tell me a joke.", "Name three rivers."]

"""A thinking model's <think>...</think> apart from its answer, whole and streamed in any chunking."""
from __future__ import annotations

import random

import pytest

from shared.reasoning import Splitter, opens_thinking, split

CASES = [("<think>\nhmm, 2 + 2\n</think>\n\nFour.", ("hmm, 2 + 2", "Four.")),
         ("Just an answer.", (None, "Just an answer.")),
         ("  <think>a</think>b", ("a", "b")),
         ("<think>still thinking", ("still thinking", "")),
         ("a < b and </thin k", (None, "a < b and </thin k"))]


@pytest.mark.parametrize("text, want", CASES)
def test_split(text, want):
    assert split(text) == want


def test_a_prompt_that_ends_inside_the_thinking():
    assert split("mm</think>Yes.", started=True) == ("mm", "Yes.")
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and opens_thinking("assistant <think>")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<think>a</think> b <think> c") and not opens_thinking("<|im_start|>assistant\n")


@pytest.mark.parametrize("text, want", CASES)
def test_any_chunking_streams_the_same(text, want):
    rng = random.Random(len(text))
    for _ in range(20):
        sp, r, c, i = Splitter(), "", "", 0
        while i < len(text):
            n = rng.randint(1, 4)
            a, b = sp.push(text[i:i + n], final=i + n >= len(text))
            r, c, i = r + a, c + b, i + n
        assert (r or None, c) == want

"""Streaming detokenisation never emits broken UTF-8; stop strings are found across token boundaries."""
from __future__ import annotations

import pytest

from shared.detokenizer import IncrementalDetokenizer, StopChecker
from shared.text_output import ChoiceText


@pytest.fixture(scope="module")
def tok(model_path):
    from shared.tokenizer import Tokenizer
    return Tokenizer(model_path)


@pytest.mark.parametrize("text", ["Hello, world! Café au lait 🤗🚀 — naïve 日本語のテキスト.",
                                  "  leading spaces and\nnew lines\t\ttabs", "emoji 👩‍👩‍👧‍👦 family"])
def test_incremental_equals_whole_and_never_broken(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


@pytest.mark.parametrize("include, want", [(False, "abc "), (True, "abc STOP")])
def test_stop_checker_spans_pushes(include, want):
    """Found across pushes; the stop string itself left out, or kept where asked (include_stop_str_in_output)."""
    s = StopChecker(["STOP", "\n\n"], include)
    out = []
    for piece in ["abc S", "TO", "P tail"]:
        text, hit = s.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == want and hit


def test_stop_checker_holds_back_only_possible_prefixes_at_end():
    s = StopChecker(["xyz"])
    assert s.push("hello") == ("hel", False)
    assert s.push(" world") == ("lo wor", False)
    assert s.flush() == "ld"


def test_choice_text_reports_stop_and_ignores_later_tokens(tok):
    ids = tok.encode("one, two, three, four")
    c = ChoiceText(tok, ["three"], prompt_ids=[])
    texts = []
    for i in ids:
        d = c.push([i], None)
        texts.append(d.text)
        if d.finish_reason:
            assert d.stop_string_hit and d.finish_reason == "stop"
            break
    assert "".join(texts) == "one, two, "
    assert c.push([5], None).text == ""


def test_the_stop_string_kept_is_the_first_listed_at_the_earliest_place():
    assert StopChecker(["STOP", "ST", "c"], True).push("ab STOP c") == ("ab STOP", True)
    assert StopChecker(["ST", "STOP"], True).push("ab STOP c") == ("ab ST", True)


def test_special_tokens_written_where_asked(tok, model_path):
    ids = tok.encode("Hi there") + [tok.eos_token_id] + tok.encode(" more")
    for skip in (True, False):
        c = ChoiceText(tok, [], [], skip_special=skip)
        text = "".join(c.push([i], None).text for i in ids) + c.push([], "stop").text
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in text) is (not skip)

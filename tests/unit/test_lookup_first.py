"""Lookup first (shared.spec.lookup): which sequences are drafted by prompt lookup alone, with what chain, and
when a sequence rests from it. The greedy identity of the proposer that uses it: tests/parity/test_speculative.py."""
from __future__ import annotations

import torch

from shared.engine.sequence import Sequence
from shared.sampling_params import SamplingParams
from shared.spec.lookup import MISSES, REST_STEPS, LookupFirst, NgramIndex, find_continuation
from shared.spec.proposers import prompt_lookup


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(temperature=0, max_tokens=100))


def test_find_continuation_is_prompt_lookup_at_one_n():
    g = torch.Generator().manual_seed(0)
    for case in range(300):
        tokens = torch.randint(0, 4 + case % 5, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for n in (1, 2, 3):
            for k in (1, 4, 9):
                assert find_continuation(tokens, k, n) == prompt_lookup(tokens, k, max_n=n, min_n=n), (tokens, n, k)


def test_the_ngram_index_answers_as_the_scan_while_the_text_grows():
    g = torch.Generator().manual_seed(1)
    for case in range(40):
        tokens = torch.randint(0, 3 + case % 6, (120,), generator=g).tolist()
        index, text = NgramIndex(), []
        for t in tokens:
            text.append(t)
            for n in (1, 2, 3, 4):
                for k in (1, 5):
                    assert index.continuation(text, k, n) == find_continuation(text, k, n), (text, n, k)
        del text[60:]                                                # shrunk: indexed again
        text += [7, 7]
        for n in (1, 2, 3):
            assert index.continuation(text, 4, n) == find_continuation(text, 4, n)


def test_chains_follow_the_longest_earlier_match():
    lookup = LookupFirst(2)
    # the last 2 tokens (7, 8) occur twice; the last 4 (5, 6, 7, 8) only at the start: that copy is followed
    s = seq([5, 6, 7, 8, 1, 2, 3, 9, 7, 8, 4, 4, 5, 6, 7, 8])
    assert lookup.chains([s], [3]) == {0: [1, 2, 3]}
    assert lookup.chains([seq([1, 2, 3, 4])], [3]) == {}                     # nothing repeats
    assert lookup.chains([seq([1, 2, 3, 1, 2])], [3]) == {0: [3, 1, 2]}
    assert lookup.chains([seq([1, 2, 3, 1, 2])], [0]) == {}                  # K = 0: no draft at all
    assert LookupFirst(0).chains([s], [3]) == {}                             # off
    s = seq([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    s.lookup_k = 5                                                           # the engine's cap for lookup chains
    assert LookupFirst(2).chains([s], [2]) == {0: [3, 4, 5, 6, 7]}


def test_a_sequence_whose_lookups_miss_rests_then_tries_again():
    lookup = LookupFirst(2)
    s = seq([1, 2, 3, 4, 1, 2])

    def refused(chain: list[int]) -> None:          # the target takes another token, then the text repeats again
        s.token_ids.extend([chain[0] + 100, 1, 2])

    chain = lookup.chains([s], [2])[0]
    assert chain == [3, 4]
    for _ in range(MISSES - 1):
        refused(chain)
        chain = lookup.chains([s], [2])[0]
    refused(chain)                     # the last miss: counted when the next proposal reads the text
    assert [0 in lookup.chains([s], [2]) for _ in range(REST_STEPS)] == [False] * REST_STEPS
    chain = lookup.chains([s], [2])[0]                                      # then it tries again
    refused(chain)
    chain = lookup.chains([s], [2])[0]
    assert lookup.tracks[s.seq_id].misses == 1
    s.token_ids.extend([chain[0], 7, 1, 2])                                 # its first token accepted: no miss
    lookup.chains([s], [2])
    assert lookup.tracks[s.seq_id].misses == 0
    lookup.release(s.seq_id)
    assert not lookup.tracks

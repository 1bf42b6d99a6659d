"""Lookup first: a sequence whose text repeats its context is drafted by prompt lookup alone.

When an answer copies its prompt (a rewrite, a correction, code edited in place, a quoted list), the tokens that
followed the latest earlier occurrence of the sequence's last n tokens are a better draft than a small head's, and
cost nothing to make: no head pass, only a chain for the target to verify: up to the sequence's `lookup_k` (the
engine's num_lookup_tokens for requests that leave K to the deployment, as a copied span is accepted far deeper
than a head's guesses; else K). `LookupFirst.chains` picks those sequences; the proposer drafts the others as
before.

A sequence whose lookup drafts were refused outright twice in a row (the text only looked like a repeat) rests
from lookup for REST_STEPS proposals. Point-mass drafts (no q) keep rejection sampling exact for sampled requests
as for greedy ones (shared.engine.rejection).
"""
from __future__ import annotations

from shared.engine.sequence import Sequence

LOOKUP_N = 2           # the serving default: a sequence whose last 2 tokens occurred before is drafted by lookup
MISSES = 2             # lookup drafts refused outright in a row before a sequence rests from lookup
REST_STEPS = 8         # proposals a resting sequence is drafted without lookup
LONGER = 2             # matches of up to n + LONGER tokens are tried first
MIN_CHAIN = 2          # a shorter continuation (the match sits at the end of the text) leaves the sequence to the head


def find_continuation(tokens: list[int], k: int, n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens ([] if none): what
    shared.spec.proposers.prompt_lookup gives with max_n = min_n = n, comparing the last token first."""
    size = len(tokens)
    if k < 1 or n < 1 or size <= n:
        return []
    tail = tokens[size - n:]
    last = tail[-1]
    for end in range(size - 2, n - 2, -1):           # the candidate match is tokens[end - n + 1 .. end]
        if tokens[end] == last and tokens[end - n + 1:end + 1] == tail:
            return tokens[end + 1:end + 1 + k]
    return []


class NgramIndex:
    """The latest end of every n-gram of one growing text, so that a step's lookup costs O(n + k) instead of a scan
    of the text (a batch of long sequences would otherwise pay a scan each per step). `continuation` answers as
    find_continuation does. The text only grows between calls (drafts are appended after the lookup and removed
    before the next); one that shrank is indexed again."""
    __slots__ = ("ends", "upto")

    def __init__(self) -> None:
        self.ends: dict[int, dict[tuple[int, ...], int]] = {}     # n -> n-gram -> its latest end
        self.upto: dict[int, int] = {}                            # n -> ends below it are indexed

    def continuation(self, tokens: list[int], k: int, n: int) -> list[int]:
        size = len(tokens)
        if k < 1 or n < 1 or size <= n:
            return []
        ends = self.ends.setdefault(n, {})
        start = self.upto.get(n, n - 1)
        if start > size - 1:                          # the text shrank
            ends.clear()
            start = n - 1
        for end in range(start, size - 1):            # the tail (ending at size - 1) is not its own match
            ends[tuple(tokens[end - n + 1:end + 1])] = end
        self.upto[n] = size - 1
        end = ends.get(tuple(tokens[size - n:]))
        return [] if end is None else tokens[end + 1:end + 1 + k]


class _Track:
    __slots__ = ("base", "chain", "misses", "rest", "index")

    def __init__(self) -> None:
        self.base, self.chain, self.misses, self.rest = 0, [], 0, 0
        self.index = NgramIndex()

    def observe(self, tokens: list[int]) -> None:
        """Counts the last lookup draft a miss when the target accepted none of it."""
        if not self.chain:
            return
        accepted = tokens[self.base:self.base + 1] == self.chain[:1]
        self.chain = []
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= MISSES:
            self.misses, self.rest = 0, REST_STEPS


class LookupFirst:
    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"lookup n must be >= 0 (0 = off), got {n}")
        self.n = n
        self.tracks: dict[int, _Track] = {}

    def chains(self, seqs: list[Sequence], ks: list[int]) -> dict[int, list[int]]:
        """index in seqs -> the lookup chain (up to ks[i] tokens) of each sequence drafted by lookup this step."""
        if not self.n:
            return {}
        out: dict[int, list[int]] = {}
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k < 1:
                continue
            track = self.tracks.get(seq.seq_id)
            if track is None:
                track = self.tracks[seq.seq_id] = _Track()
            track.observe(seq.token_ids)
            if track.rest:
                track.rest -= 1
                continue
            chain: list[int] = []
            longest = seq.lookup_k or k                         # the engine's cap for lookup chains, if it set one
            for n in range(self.n + LONGER, self.n - 1, -1):    # the longest match places the copy best
                chain = track.index.continuation(seq.token_ids, longest, n)
                if chain:
                    break
            # measured against the proposer's k, as a draft service's mirror of the sequence (no lookup_k) does
            if len(chain) >= min(k, MIN_CHAIN):
                track.base, track.chain = len(seq.token_ids), chain
                out[i] = chain
        return out

    def release(self, seq_id: int) -> None:
        self.tracks.pop(seq_id, None)

"""Whether speculation pays on this deployment, measured: the decode rate of requests that ran alone, with drafts and
without, and speculation only while it has been at least as fast.

A draft round costs a proposal in the draft service, a Verify round trip and a verification of several rows; on some
CPUs (a slow dot product, fast memory) that costs more than the tokens it saves, and then plain decoding is faster
for a single stream. The router measures both sides on live traffic: requests that give `num_speculative_tokens`
themselves are measured as they ran (but K = 0 where the targets draft the requests sent without a draft service
by prompt lookup: that side speculates too, and a plain request says nothing about it); the others speculate while
the speculative rate is at least the plain rate (until the side without drafts is first measured, every other one
takes it: the default is a guess), and every `explore_every`-th of them takes the other side so that both rates
stay current (every RARE x `explore_every`-th while one side is CLEAR_MARGIN times faster: exploring a
clear loser costs throughput), unless requests that set their own K measured that side meanwhile. With lookup at the
targets a near tie (drafts less than LOOKUP_TIE times faster) goes to the side without drafts: it copies as fast,
and the draft service's relay and probes cost CPU the target's steps share.
"""
from __future__ import annotations

import logging

log = logging.getLogger("upesi.router")
CLEAR_MARGIN, RARE = 1.25, 4    # a side this many times faster: the other is explored RARE times less often
LOOKUP_TIE = 1.05               # with lookup at the targets, drafts are kept only while this many times faster


class SpeculationGuard:
    def __init__(self, explore_every: int = 8, alpha: float = 0.3, min_tokens: int = 16,
                 lookup_at_targets: bool = False) -> None:
        self.explore_every, self.alpha, self.min_tokens = explore_every, alpha, min_tokens
        # the targets draft by prompt lookup what is sent without drafts: a client's K = 0 is not that side
        self.lookup_at_targets = lookup_at_targets
        self.rate: dict[bool, float | None] = {True: None, False: None}      # tokens/s, with drafts / without
        self.decisions = 0
        # the decision count at the last measurement of each side by a request that chose it itself
        self.measured: dict[bool, int | None] = {True: None, False: None}

    def use_drafts(self) -> bool:
        """For a request that runs alone and leaves K to the deployment: speculate or not."""
        self.decisions += 1
        spec, plain = self.rate[True], self.rate[False]
        if spec is None:
            return True                                  # nothing measured yet: the deployment's default
        if plain is None:                                # the default is a guess: the other side is measured
            return self.decisions % 2 == 1               # early, every other request until one counts
        # with lookup at the targets the side without drafts gets the copies' speed-up too, without the draft
        # service's relay and probes (CPU the target's steps share): a near tie goes to it
        better = spec >= plain * (LOOKUP_TIE if self.lookup_at_targets else 1.0)
        clear = max(spec, plain) >= CLEAR_MARGIN * min(spec, plain)
        every = self.explore_every * (RARE if clear else 1)
        last = self.measured[not better]
        if self.decisions % every == 0 and (last is None or self.decisions - last >= every):
            return not better            # the other side, now and then (rarely when far behind), unless requests
        return better                    # that chose it themselves measured it since

    def record(self, drafts: bool, tokens: int, seconds: float, own_choice: bool = False,
               asked_plain: bool = False) -> None:
        """A request that ran alone: `tokens` decoded after its first one, in `seconds`; own_choice: its K was the
        client's, not this guard's; asked_plain: that K was 0, which measures the side without drafts only where
        the targets do not draft such requests by lookup."""
        if tokens < self.min_tokens or seconds <= 0 or (asked_plain and self.lookup_at_targets):
            return
        if own_choice:
            self.measured[drafts] = self.decisions
        rate, old = tokens / seconds, self.rate[drafts]
        self.rate[drafts] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        log.debug("decode rate alone %s drafts: %.1f tok/s (with %s, without %s)", "with" if drafts else "without",
                  rate, self.rate[True], self.rate[False])

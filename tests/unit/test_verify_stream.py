"""The target's side of a Verify stream without gRPC: what StreamProposer sends for each engine step (verdict
deltas, hidden states only to a draft that reads them, one-way releases), and how it copes with a silent draft."""
from __future__ import annotations

import asyncio

import torch

from services.target.verify import StreamProposer
from shared.engine.proposal import NO_PROPOSAL, Proposal
from shared.engine.sequence import Sequence
from shared.sampling_params import SamplingParams
from upesi.v1 import target_pb2


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(temperature=0, max_tokens=64))


async def _exchange(proposer: StreamProposer, outbox: asyncio.Queue, seqs, ks, answer):
    """Runs propose on a worker thread (as the engine thread does) and answers its message with `answer(msg)`."""
    task = asyncio.get_running_loop().run_in_executor(None, proposer.propose, seqs, ks)
    msg = await asyncio.wait_for(outbox.get(), 5)
    reply = answer(msg)
    if reply is not None:
        proposer.answer(msg.step, reply)
    return msg, await task


def _proposals(*token_lists) -> target_pb2.ProposeResponse:
    return target_pb2.ProposeResponse(proposals=[target_pb2.DraftProposal(tokens=t) for t in token_lists])


def test_verdicts_go_as_deltas_with_hidden_states_and_proposals_come_back():
    async def main():
        outbox: asyncio.Queue = asyncio.Queue()
        p = StreamProposer(asyncio.get_running_loop(), outbox, timeout_s=5)
        seq = _seq([5, 6, 7])
        p.accept_hidden(seq, 0, torch.ones(2, 4))                    # positions 0, 1
        msg, out = await _exchange(p, outbox, [seq], [3], lambda m: _proposals([8, 9, 10]))
        (s,) = msg.propose.seqs
        assert (s.base, list(s.tokens), s.k, s.hidden_start, s.hidden_rows, s.hidden_dim) == (0, [5, 6, 7], 3, 0, 2, 4)
        assert out == [Proposal([8, 9, 10])]
        seq.token_ids += [8, 11]                                     # 8 accepted, 11 the correction
        p.accept_hidden(seq, 2, torch.zeros(2, 4))
        msg, _ = await _exchange(p, outbox, [seq], [2], lambda m: _proposals([12, 13]))
        (s,) = msg.propose.seqs
        assert (s.base, list(s.tokens), s.hidden_start, s.hidden_rows) == (3, [8, 11], 2, 2)
        p.wants_hidden = False                                       # a draft that reads none (its hello)
        p.accept_hidden(seq, 4, torch.zeros(1, 4))
        msg, _ = await _exchange(p, outbox, [seq], [2], lambda m: _proposals([1]))
        assert msg.propose.seqs[0].hidden == b""
        p.release(seq.seq_id)                                        # one-way: step 0, no answer awaited
        rel = await asyncio.wait_for(outbox.get(), 5)
        assert rel.step == 0 and list(rel.propose.released) == [str(seq.seq_id)] and not rel.propose.seqs
        p.release(seq.seq_id)                                        # only once
        await asyncio.sleep(0.05)
        assert outbox.empty()
    asyncio.run(main())


def test_a_silent_draft_costs_one_timeout_then_steps_go_on_without_it():
    async def main():
        outbox: asyncio.Queue = asyncio.Queue()
        p = StreamProposer(asyncio.get_running_loop(), outbox, timeout_s=0.2)
        seq = _seq([1, 2, 3])
        msg, out = await _exchange(p, outbox, [seq], [2], lambda m: None)       # never answered
        assert out == [NO_PROPOSAL] and p.sent == {} and p.unanswered == msg.step
        for _ in range(3):                                                       # no step waits for it again
            out = await asyncio.get_running_loop().run_in_executor(None, p.propose, [seq], [2])
            assert out == [NO_PROPOSAL] and outbox.empty()
        p.answer(msg.step, _proposals([7]))                                      # its late answer: it is back
        assert p.unanswered is None
        msg2, out = await _exchange(p, outbox, [seq], [2], lambda m: _proposals([4]))
        assert msg2.step > msg.step and list(msg2.propose.seqs[0].tokens) == [1, 2, 3]   # whole sequence again
        assert out[0].tokens == [4]
        p.release(seq.seq_id)                                                    # it may hold a mirror: release
        assert (await asyncio.wait_for(outbox.get(), 5)).propose.released == [str(seq.seq_id)]
    asyncio.run(main())


def test_a_closed_stream_ends_the_wait_at_once():
    async def main():
        outbox: asyncio.Queue = asyncio.Queue()
        p = StreamProposer(asyncio.get_running_loop(), outbox, timeout_s=30)
        seq = _seq([1, 2])
        loop = asyncio.get_running_loop()
        msg, out = await _exchange(p, outbox, [seq], [2], lambda m: loop.call_later(0.05, p.close) and None)
        assert out == [NO_PROPOSAL] and not p.alive
        assert await loop.run_in_executor(None, p.propose, [seq], [2]) == [NO_PROPOSAL]
    asyncio.run(main())


def test_an_answer_for_another_step_is_ignored():
    async def main():
        outbox: asyncio.Queue = asyncio.Queue()
        p = StreamProposer(asyncio.get_running_loop(), outbox, timeout_s=0.3)
        seq = _seq([1, 2])

        def stale(m):
            p.answer(m.step + 7, _proposals([9]))                    # a late answer to some other step
            return None
        _, out = await _exchange(p, outbox, [seq], [1], stale)
        assert out == [NO_PROPOSAL]
    asyncio.run(main())


def test_malformed_proposals_are_dropped_not_allowed_to_fail_the_step():
    async def main():
        outbox: asyncio.Queue = asyncio.Queue()
        p = StreamProposer(asyncio.get_running_loop(), outbox, timeout_s=5, vocab_size=50)
        a, b, c, d = _seq([1, 2]), _seq([3, 4]), _seq([5, 6]), _seq([7, 8])
        bad_q = target_pb2.DraftProposal(tokens=[1], probs=b"\0" * 10, vocab=50)        # 10 bytes, not 4 * 1 * 50
        wrong_v = target_pb2.DraftProposal(tokens=[1], probs=b"\0" * 4 * 7, vocab=7)     # q over 7 tokens, not 50
        reply = target_pb2.ProposeResponse(proposals=[target_pb2.DraftProposal(tokens=[9, 10, 11, 12]),
                                                      target_pb2.DraftProposal(tokens=[60]), bad_q, wrong_v])
        _, out = await _exchange(p, outbox, [a, b, c, d], [2, 2, 2, 2], lambda m: reply)
        assert out == [Proposal([9, 10]), NO_PROPOSAL, NO_PROPOSAL, NO_PROPOSAL]     # trimmed to k; the rest dropped
    asyncio.run(main())


def test_the_mux_sends_to_every_stream_before_waiting_on_any():
    """Two draft services' streams in one engine step: both get their verdicts before the step waits, so their
    drafts compute at the same time. Here each draft answers only once both messages are out, which a mux that
    waited on one stream before sending to the next could never see (it would time out)."""
    from shared.spec.proposer_mux import ProposerMux

    async def main():
        loop = asyncio.get_running_loop()
        boxes = [asyncio.Queue(), asyncio.Queue()]
        streams = [StreamProposer(loop, box, timeout_s=5) for box in boxes]
        mux = ProposerMux()
        seqs = [Sequence(f"r{i}", 0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=64)) for i in range(2)]
        for s, p in zip(seqs, streams):
            mux.add(p)
            mux.bind(s.request_id, p)
        task = loop.run_in_executor(None, mux.propose, seqs, [2, 2])
        msgs = [await asyncio.wait_for(box.get(), 2) for box in boxes]         # both sent before any answer
        for p, m, toks in zip(streams, msgs, ([7, 8], [9])):
            p.answer(m.step, _proposals(toks))
        assert await task == [Proposal([7, 8]), Proposal([9])]
    asyncio.run(main())


def test_draft_trees_cross_the_stream_checked():
    from services.draft.codec import proposals_to_pb

    async def main():
        outbox: asyncio.Queue = asyncio.Queue()
        p = StreamProposer(asyncio.get_running_loop(), outbox, timeout_s=5, vocab_size=50)
        seqs = [_seq([1, 2]) for _ in range(5)]
        tree = Proposal([9, 10, 11, 12], None, [-1, -1, 0, 2])                # depth 3: kept whole at k = 3
        reply = proposals_to_pb([tree,
                                 Proposal([9, 10, 11], None, [-1, 1, 0]),     # a parent after its child
                                 Proposal([9, 10, 11, 12], None, [-1, -1, 0, 2]),   # depth 3 > k = 2
                                 Proposal([9, 60], None, [-1, -1]),           # outside the vocab
                                 Proposal([3] * 65, None, [-1] * 65)], wants_hidden=False)   # too many nodes
        assert list(reply.proposals[0].parents) == [-1, -1, 0, 2] and not reply.proposals[0].probs
        _, out = await _exchange(p, outbox, seqs, [3, 3, 2, 3, 3], lambda m: reply)
        assert out == [tree, NO_PROPOSAL, NO_PROPOSAL, NO_PROPOSAL, NO_PROPOSAL]
    asyncio.run(main())


def test_the_mux_drafts_repeated_text_by_lookup_without_an_exchange():
    """Lookup first on the target's side: a streamed sequence whose text repeats is drafted by prompt lookup and
    left out of the step's exchange; its hidden states go to the draft with the next exchange."""
    from shared.spec.proposer_mux import ProposerMux

    async def main():
        loop = asyncio.get_running_loop()
        box: asyncio.Queue = asyncio.Queue()
        stream = StreamProposer(loop, box, timeout_s=5)
        mux = ProposerMux()
        mux.add(stream)
        seq = _seq([4, 5, 6, 4, 5])
        mux.bind(seq.request_id, stream)
        mux.accept_hidden(seq, 0, torch.ones(4, 3))                          # positions 0 .. 3
        assert await loop.run_in_executor(None, mux.propose, [seq], [2]) == [Proposal([6, 4])]
        assert box.empty()                                                    # no exchange this step
        seq.token_ids += [9, 7]                                               # the lookup draft refused: 9
        mux.accept_hidden(seq, 4, torch.zeros(2, 3))                          # positions 4, 5
        task = loop.run_in_executor(None, mux.propose, [seq], [2])
        msg = await asyncio.wait_for(box.get(), 5)
        stream.answer(msg.step, _proposals([1, 2]))
        (s,) = msg.propose.seqs
        assert await task == [Proposal([1, 2])] and (s.base, list(s.tokens)) == (0, [4, 5, 6, 4, 5, 9, 7])
        assert (s.hidden_start, s.hidden_rows) == (0, 6)                     # every position since the start
        mux.release(seq.seq_id)
        assert not mux.lookup.tracks
    asyncio.run(main())

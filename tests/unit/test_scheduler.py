"""Continuous batching: chunked prefill never stalls decodes; preemption frees and recomputes."""
from __future__ import annotations

from shared.engine.prefill_pacer import FLOOR, PrefillPacer
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence, Status
from shared.kv.block_manager import BlockManager
from shared.sampling_params import SamplingParams


def make(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(range(1, n + 1)), SamplingParams(temperature=0))


def run_step(batch) -> None:
    """What the engine does after a forward pass: mark tokens computed, append a token to caught-up ones."""
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == len(s):
            s.token_ids.append(7)


def test_long_prompt_is_chunked_while_decodes_continue():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make(3, "a"), make(3, "b")
    sch.add(a), sch.add(b)
    run_step(sch.schedule())                          # both prefill in one step (6 tokens)
    long = make(40, "long")
    sch.add(long)
    chunks = []
    for _ in range(6):
        batch = sch.schedule()
        assert batch.seqs[:2] == [a, b] and batch.num_tokens[:2] == [1, 1]      # decodes every step
        assert sum(batch.num_tokens) <= 10
        chunks.append(dict(zip((s.seq_id for s in batch.seqs), batch.num_tokens)).get(long.seq_id, 0))
        run_step(batch)
    assert chunks == [8, 8, 8, 8, 8, 1]               # 40 prompt tokens in chunks of the leftover budget, then decode
    assert long.num_output_tokens == 2


def test_prompts_alone_take_longer_chunks_until_a_sequence_decodes():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, prefill_chunk_tokens=24)
    long, other = make(40, "long"), make(30, "other")
    sch.add(long)
    first = sch.schedule()
    assert first.num_tokens == [24]                    # nothing decodes: the longer budget
    run_step(first)
    sch.add(other)
    second = sch.schedule()
    assert second.num_tokens == [16, 8]                # still only prompts: 24 tokens, the rest of long first
    run_step(second)
    third = sch.schedule()                             # long now decodes: back to the step budget of 10
    assert third.seqs == [long, other] and third.num_tokens == [1, 9]
    run_step(third)


def test_pacer_sizes_chunks_beside_decodes_by_measured_step_times():
    pacer = PrefillPacer(stretch=2.0, ceiling=64)
    assert pacer.budget() is None                      # nothing measured: the scheduler's own budget
    pacer.observe(decodes=0, prompt_tokens=40, seconds=1.0)
    assert pacer.budget() is None                      # a prompt alone says nothing about decodes
    pacer.observe(decodes=2, prompt_tokens=0, seconds=0.010)
    assert pacer.budget() == FLOOR                     # a first small chunk to measure a token's cost
    pacer.observe(decodes=2, prompt_tokens=16, seconds=0.010 + 16 * 0.0005)
    assert pacer.budget() == 20                        # (2 - 1) x 10 ms / 0.5 ms a token
    for _ in range(40):
        pacer.observe(decodes=2, prompt_tokens=20, seconds=0.010 + 20 * 0.002)   # later positions cost more
    assert pacer.budget() == FLOOR                     # 10 ms / 2 ms = 5 tokens, raised to the floor
    for _ in range(40):
        pacer.observe(decodes=2, prompt_tokens=16, seconds=0.010 + 16 * 0.00001)
    assert pacer.budget() == 64                        # cheap tokens: up to the ceiling


def test_scheduler_gives_a_prompt_the_paced_tokens_beside_decodes():
    pacer = PrefillPacer(stretch=3.0, ceiling=64)
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_tokens=128,
                    pacer=pacer)
    a = make(3, "a")
    sch.add(a)
    run_step(sch.schedule())                           # a prompt alone: not paced
    pacer.observe(decodes=1, prompt_tokens=0, seconds=0.010)
    pacer.observe(decodes=1, prompt_tokens=FLOOR, seconds=0.010 + FLOOR * 0.001)    # 20 tokens fit
    long = make(100, "long")
    sch.add(long)
    batch = sch.schedule()
    assert batch.seqs == [a, long] and batch.num_tokens == [1, 20]
    assert batch.prompt_split() == (1, 20)
    run_step(batch)
    sch.finish(a, "stop")
    alone = sch.schedule()                             # nothing decodes any more: the long budget again
    assert alone.num_tokens == [80]


def test_preemption_when_blocks_run_out():
    sch = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make(4, "a"), make(4, "b")
    sch.add(a), sch.add(b)
    run_step(sch.schedule())                          # a, b: 4 tokens each, 1 block each, then one more token
    run_step(sch.schedule())                          # decode: both need a 2nd block -> 4 blocks used
    assert sch.blocks.num_free_blocks == 0
    for _ in range(3):
        run_step(sch.schedule())                      # fills the 2nd blocks (positions 5..7)
    batch = sch.schedule()                            # a needs a 3rd block: b (newest) is preempted
    assert batch.seqs == [a]
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sch.num_preemptions == 1
    sch.finish(a, "stop")
    assert sch.blocks.num_free_blocks == 4


def test_a_tenants_flood_queues_behind_itself_not_before_another_tenant():
    sch = Scheduler(BlockManager(256, 4), max_num_seqs=4, max_num_batched_tokens=64)
    flood = [Sequence(f"a{i}", 0, [1, 2, 3], SamplingParams(temperature=0, tenant="alice")) for i in range(20)]
    bob = Sequence("b", 0, [4, 5, 6], SamplingParams(temperature=0, tenant="bob"))
    for s in flood:
        sch.add(s)
    sch.add(bob)                                       # arrives last, behind 20 of alice's requests
    first = sch.schedule()
    assert first.seqs[:2] == [flood[0], bob]           # alice runs one: bob, running none, goes next
    assert [s.request_id for s in first.seqs] == ["a0", "b", "a1", "a2"]
    # one tenant alone: first come, first served as before
    solo = Scheduler(BlockManager(256, 4), max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [make(3, f"s{i}") for i in range(5)]
    for s in seqs:
        solo.add(s)
    assert solo.schedule().seqs == seqs[:3]

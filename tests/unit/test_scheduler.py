"""Continuous batching: chunked prefill never stalls decodes; preemption frees and recomputes."""
from __future__ import annotations

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

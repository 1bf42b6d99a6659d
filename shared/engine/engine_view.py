"""What a service may read of an engine that runs on its own thread (AsyncEngine): its fixed facts (model, limits)
and a snapshot of its load. Counts read from another thread are reports, not decisions; everything that changes
the engine goes through AsyncEngine.call."""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


def engine_info(e: LLMEngine) -> EngineInfo:
    return EngineInfo(e.model_cfg.name, e.max_model_len, e.model_cfg.vocab_size, tuple(sorted(e.eos_token_ids)),
                      e.cfg.block_size, e.block_manager.num_blocks, e.cfg.max_num_seqs)


def engine_load(e: LLMEngine) -> EngineLoad:
    return EngineLoad(len(e.scheduler.running), len(e.scheduler.waiting), e.block_manager.num_used_blocks,
                      e.block_manager.num_blocks)

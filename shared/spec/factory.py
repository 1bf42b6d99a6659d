"""Proposers by name, and engines that speculate in process with one."""
from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.proposal import Proposer
from shared.spec.eagle_proposer import make_eagle
from shared.spec.proposers import DraftModelProposer, NgramProposer


def make_proposer(spec: str, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                  max_len: int, target: torch.nn.Module | None = None, target_path: str | None = None,
                  draft_confidence: float | None = None, draft_tree_nodes: int | None = None,
                  draft_tree_ngram: int | None = None) -> Proposer:
    """`ngram`, `draft-model:PATH` or `eagle:PATH`. An eagle head takes the target's embedding, final norm and LM
    head from `target` (in-process) or else from the checkpoint at `target_path` (None = the default model), stops
    a draft below `draft_confidence`, drafts trees of `draft_tree_nodes` for greedy sequences and grafts prompt
    lookup's continuation of up to `draft_tree_ngram` tokens onto them (None: shared.spec.eagle_proposer.SERVING)."""
    kind, _, arg = spec.partition(":")
    factories: dict[str, Callable[[], Proposer]] = {
        "ngram": lambda: NgramProposer(),
        "draft-model": lambda: DraftModelProposer(arg, num_blocks, block_size, dtype, device, max_len),
        "eagle": lambda: make_eagle(arg, dtype, device, target, target_path, draft_confidence,
                                   draft_tree_nodes, draft_tree_ngram),
    }
    if kind not in factories or (kind != "ngram" and not arg):
        raise ValueError(f"unknown speculative proposer {spec!r}; use 'ngram', 'draft-model:PATH' or 'eagle:PATH'")
    return factories[kind]()


def engine_proposer(cfg: EngineConfig, target: torch.nn.Module, max_len: int) -> Proposer:
    """The in-process proposer `cfg.speculative` names, for an engine serving `target`."""
    return make_proposer(cfg.speculative or "", cfg.draft_kv_blocks, cfg.block_size, cfg.torch_dtype(),
                         cfg.torch_device(), max_len, target=target, draft_confidence=cfg.draft_confidence,
                         draft_tree_nodes=cfg.draft_tree_nodes, draft_tree_ngram=cfg.draft_tree_ngram)


def build_engine(cfg: EngineConfig) -> LLMEngine:
    """An LLMEngine; with `cfg.speculative` set, it drafts with that proposer in process."""
    return LLMEngine(cfg, make_proposer=engine_proposer)

"""wide_threads: forward steps over WIDE_ROWS rows or more (prefill, a draft verification's K + 1 rows) run on
wide_threads torch threads, one-row decode steps on num_threads; outputs stay the plain greedy ones."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import WIDE_ROWS, EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.testing.tiny_llama import save_tiny
from shared.testing.scripted_proposer import PROMPT, Scripted

K = WIDE_ROWS      # K + 1 rows per verification: a wide step


def test_wide_steps_run_on_wide_threads(tmp_path):
    save_tiny(tmp_path, None)
    before = torch.get_num_threads()
    try:
        eng = LLMEngine(EngineConfig(model=str(tmp_path), progress=False, num_kv_blocks=64, block_size=4,
                                     num_threads=1, wide_threads=2, num_speculative_tokens=K,
                                     adaptive_speculation=False))
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        seen: list[tuple[int, int]] = []                               # (rows, threads) of every forward step
        run = eng.runner.run

        def recording(batch):
            seen.append((sum(batch.num_tokens), torch.get_num_threads()))
            return run(batch)
        eng.runner.run = recording
        greedy = eng.generate([PROMPT + [2, 4, 6]], params)[0][0]    # prefill of 7 rows, then one-row decodes
        eng.proposer = Scripted(greedy, eng.model_cfg.vocab_size)
        eng.proposer.right = True                                      # every verification: K + 1 rows
        spec = eng.generate([PROMPT + [2, 4, 6]], params)[0][0]
        assert spec == greedy
        assert {t for rows, t in seen if rows >= WIDE_ROWS} == {2}
        assert {t for rows, t in seen if rows < WIDE_ROWS} == {1}      # the plain run's decode steps
        assert sum(rows >= WIDE_ROWS for rows, _ in seen) >= 3         # the prefills and the verifications
        assert torch.get_num_threads() == 1                            # back to num_threads after each
    finally:
        torch.set_num_threads(before)
    from services.launcher import ServeConfig
    from services.target.config import TargetConfig
    for cls in (EngineConfig, TargetConfig, ServeConfig):
        with pytest.raises(ValueError, match="wide_threads"):
            cls(wide_threads=0)

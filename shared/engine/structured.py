"""Structured outputs: a request's grammar (JSON schema, any JSON, regex, choice or EBNF) masks the logits of each
token it generates, with xgrammar.

xgrammar was measured against llguidance on the default model's vocabulary (49,152 tokens) for a three-field JSON
schema (docs/api.md): 0.20 ms a token for the mask, 3 ms to compile, no start-up stall, against 0.06 ms a token
but 1.8-13 s for the first mask after loading the tokenizer. GrammarCompiler caches compiled grammars.

A sequence's Guide advances with every token it keeps. A speculative verification advances it through the drafts
to mask each position's row, then rolls back what was rejected, so a draft token the grammar forbids is rejected
like any other mismatch.

Shapes: V = vocab.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable

import torch

from shared.errors import InvalidRequest



class Guide:
    """One sequence's grammar state."""

    def __init__(self, compiled, vocab: int) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)                    # rolls back any number of tokens
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)            # [1, ceil(V / 32)] int32

    def apply(self, row: torch.Tensor) -> None:
        """row [V] fp32 (a view is changed in place): tokens the grammar forbids next become -inf."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self._xgr.apply_token_bitmask_inplace(row.view(1, -1), self.bitmask)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def done(self) -> bool:
        """The grammar accepted its stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def rollback(self, tokens: int) -> None:
        if tokens:
            self.matcher.rollback(tokens)


def mask_rows(logits: torch.Tensor, rows: list[int], guides: list[Guide]) -> None:
    """logits [N, V] fp32, changed in place: row rows[i] masked by guides[i]'s grammar, all in one batched fill
    (xgrammar's threads) and one masking pass."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])          # [N, ceil(V / 32)] int32
    _batch().batch_fill_next_token_bitmask([g.matcher for g in guides], bitmask, indices=rows)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


_BATCH = None


def _batch():
    global _BATCH
    if _BATCH is None:
        import xgrammar as xgr
        _BATCH = xgr.BatchGrammarMatcher()
    return _BATCH


class Guides:
    """Compiles requests' grammars for one tokenizer (lazily: the first structured request pays for the tokenizer
    table, a fraction of a second) and makes their Guides."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab: int) -> None:
        self.load_tokenizer, self.vocab = load_tokenizer, vocab
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                try:
                    hf = self.load_tokenizer()
                except Exception as e:
                    raise InvalidRequest(f"structured output needs the model's tokenizer, which did not load: "
                                         f"{str(e)[:200]}") from None
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def guide(self, kind: str, spec: str) -> Guide:
        """A Guide for the grammar; InvalidRequest naming the problem for one that does not compile."""
        c = self.compiler()
        try:
            if kind == "json_schema":
                compiled = c.compile_json_schema(spec)
            elif kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = c.compile_regex(spec)
            elif kind == "choice":
                choices = json.loads(spec)
                compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(str(x)) for x in choices))
            elif kind == "grammar":
                compiled = c.compile_grammar(spec)
            else:
                raise InvalidRequest(f"unknown structured output kind {kind!r}")
        except InvalidRequest:
            raise
        except Exception as e:                   # xgrammar's parse errors: the client's grammar is at fault
            raise InvalidRequest(f"the {kind.replace('_', ' ')} does not compile: {str(e)[:300]}") from None
        return Guide(compiled, self.vocab)

"""What a request does to the logits before sampling, and the log-probabilities it asks back.

vLLM's semantics and order: logit_bias and min_tokens first, then the penalties on those logits (repetition over
the prompt's and the output's tokens, frequency and presence over the output's); temperature, min_p, top-k and
top-p follow in shared.engine.sampler. bad_words: a word's last token is masked where the output ends with the
rest of the word (a one-token word: always). Log-probabilities come from the raw logits, before any of this, as vLLM
returns them by default.

A row is processed with the tokens before the position it predicts, so the K + 1 rows of a speculative
verification see each draft token their position follows, as plain decoding would have: greedy speculative output
equals plain greedy output with any of these set.

Shapes: R = rows, V = vocab.
"""
from __future__ import annotations

import torch

from shared.engine.delta import TokenLogprob
from shared.sampling_params import SamplingParams


def process(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int,
            ends: list[int], stop_ids: set[int]) -> torch.Tensor:
    """logits [R, V] -> a processed fp32 copy [R, V]. Row r predicts the token after token_ids[:ends[r]] (ends
    ascending, each >= num_prompt); stop_ids are masked while the output is shorter than min_tokens. Every row's
    arithmetic is the same elementwise operations, whatever the other rows, all rows at once: a verification row is
    processed as the decode row it stands for."""
    out = logits.float().clone()                                                # [R, V]
    v, dev = out.shape[-1], out.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=dev)
        out[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=out.dtype, device=dev)
    if params.min_tokens and stop_ids:
        short = [r for r, end in enumerate(ends) if end - num_prompt < params.min_tokens]
        if short:
            out[torch.tensor(short, device=dev)[:, None], torch.tensor(sorted(stop_ids), device=dev)[None, :]] = \
                float("-inf")
    for word in params.bad_words:
        *head, last = word
        for r, end in enumerate(ends):
            if not head or (end - num_prompt >= len(head) and token_ids[end - len(head):end] == head):
                out[r, last] = float("-inf")
    rp, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    if rp == 1.0 and not freq and not pres:
        return out
    first = ends[0]
    counts = torch.zeros(v, dtype=out.dtype, device=dev)                        # [V] output tokens before row 0
    if first > num_prompt:
        counts.index_add_(0, torch.tensor(token_ids[num_prompt:first], dtype=torch.long, device=dev),
                          torch.ones(first - num_prompt, dtype=out.dtype, device=dev))
    counts = counts.expand(len(ends), v).clone()                                # [R, V] each row's own
    rows = [r for r, end in enumerate(ends) for _ in range(first, end)]         # row r adds token_ids[first:end]
    if rows:
        toks = [t for end in ends for t in token_ids[first:end]]
        counts.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, dtype=torch.long, device=dev)),
                          torch.ones(len(rows), dtype=out.dtype, device=dev), accumulate=True)
    seen = counts > 0
    if rp != 1.0:
        in_prompt = torch.zeros(v, dtype=torch.bool, device=dev)
        in_prompt[torch.tensor(token_ids[:num_prompt], dtype=torch.long, device=dev)] = True
        rep = in_prompt | seen
        out = torch.where(rep, torch.where(out > 0, out / rp, out * rp), out)
    return out - freq * counts - pres * seen.to(out.dtype)


def token_logprobs(logits: torch.Tensor, chosen: list[int], top: int) -> list[TokenLogprob]:
    """Raw logits [R, V] and the token taken at each row -> its log-probability, its rank (1 + the tokens more
    likely) and the `top` most likely."""
    lp = logits.float().log_softmax(dim=-1)                                     # [R, V]
    rows = torch.arange(len(chosen), device=lp.device)
    at = lp[rows, torch.tensor(chosen, dtype=torch.long, device=lp.device)]     # [R]
    ranks = ((lp > at[:, None]).sum(dim=-1) + 1).tolist()
    picked = at.tolist()
    if not top:
        return [TokenLogprob(p, [], [], r) for p, r in zip(picked, ranks)]
    vals, idx = lp.topk(top, dim=-1)                                            # [R, top]
    return [TokenLogprob(p, i, x, r) for p, i, x, r in zip(picked, idx.tolist(), vals.tolist(), ranks)]


def rows_logprobs(logits: torch.Tensor, chosen: list[int], tops: list[int | None]) -> list[TokenLogprob | None]:
    """Raw logits [N, V], the token taken at each row and each row's top N (None: no log-probabilities) -> a
    TokenLogprob for each row that asks, None for the others: one log-softmax over the rows that ask."""
    want = [i for i, t in enumerate(tops) if t is not None]
    out: list[TokenLogprob | None] = [None] * len(tops)
    if want:
        got = token_logprobs(logits[want], [chosen[i] for i in want], max(tops[i] for i in want))
        for i, lp in zip(want, got):
            out[i] = TokenLogprob(lp.logprob, lp.top_ids[:tops[i]], lp.top_logprobs[:tops[i]], lp.rank)
    return out


def stop_ids(params: SamplingParams, eos: set[int]) -> set[int]:
    """The tokens min_tokens holds back: EOS (unless ignored) and the request's stop token ids."""
    return (set() if params.ignore_eos else set(eos)) | set(params.stop_token_ids)


def process_batch(logits: torch.Tensor, seqs: list, eos: set[int]) -> torch.Tensor:
    """logits [N, V], row i sampled for seqs[i] (shared.engine.sequence.Sequence) -> the same tensor when no
    sequence asks for processing or a grammar, else an fp32 copy with those rows processed, then masked."""
    todo = [i for i, s in enumerate(seqs) if s.params.processed or s.guide is not None]
    if not todo:
        return logits
    out = logits.float()
    out = out.clone() if out is logits else out
    for i in todo:
        s = seqs[i]
        if s.params.processed:
            out[i] = process(logits[i:i + 1], s.params, s.token_ids, s.num_prompt_tokens, [len(s)],
                             stop_ids(s.params, eos))[0]
    guided = [i for i in todo if seqs[i].guide is not None]
    if guided:
        from shared.engine.structured import mask_rows
        mask_rows(out, guided, [seqs[i].guide for i in guided])
    return out

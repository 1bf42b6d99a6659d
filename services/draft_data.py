"""The training data of `upesi train-draft` (services.train_draft_cmd): the target's answers to a prompt set, its
hidden states over prompt + answer (teacher forcing), and the reduced draft vocabulary.

Shapes: T = positions, D = hidden, N = reduced vocab.
"""
from __future__ import annotations

import os
from typing import Any


def generate_answers(engine, prompts: list[list[int]], max_tokens: int, batch: int = 128,
                     cache: str | None = None, temperature: float = 0.0, round_: int = 0) -> list[list[int]]:
    """The target's answers, `batch` prompts in flight together (continuous batching): greedy, or sampled at
    `temperature` (round r of sampling, seeded per prompt and round). With `cache`, answers already in that
    JSON-lines file (keyed by the prompt's token ids, length, temperature and round) are reused and new ones
    appended to it."""
    import json

    from tqdm import tqdm

    from shared.sampling_params import SamplingParams

    done: dict[tuple[int, ...], list[int]] = {}
    if cache and os.path.exists(cache):
        with open(cache) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if (rec.get("max_tokens"), rec.get("temperature", 0.0), rec.get("round", 0)) == \
                            (max_tokens, temperature, round_):
                        done[tuple(rec["prompt"])] = rec["answer"]
    todo = [i for i, p in enumerate(prompts) if tuple(p) not in done][::-1]
    sink = open(cache, "a") if cache else None
    out: dict[str, list[int]] = {}
    try:
        with tqdm(total=len(todo) * max_tokens, desc="target answers", unit="tok") as bar:
            while todo or engine.has_unfinished():
                while todo and len(out) < batch:             # keep `batch` answers in flight
                    i = todo.pop()
                    seed = (hash(tuple(prompts[i])) + 7919 * round_) % 2**31 if temperature else None
                    engine.add_request(str(i), prompts[i], SamplingParams(temperature=temperature,
                                                                          max_tokens=max_tokens, seed=seed))
                    out[str(i)] = []
                for d in engine.step():
                    out[d.request_id].extend(d.token_ids)
                    bar.update(len(d.token_ids))
                    if d.finish_reason:
                        ans = out.pop(d.request_id)
                        done[tuple(prompts[int(d.request_id)])] = ans
                        if sink:
                            sink.write(json.dumps({"prompt": prompts[int(d.request_id)], "max_tokens": max_tokens,
                                                   "temperature": temperature, "round": round_,
                                                   "answer": ans}) + "\n")
                            sink.flush()
    finally:
        if sink:
            sink.close()
    return [done[tuple(p)] for p in prompts]


def training_answers(engine, prompts: list[list[int]], cfg: Any
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """The training text: (prompt, answer) pairs of the greedy answers (--greedy-answers) and of sampled rounds
    --first-sample-round .. + --sampled-answers - 1, each prompt once per kind. cfg: a TrainDraftConfig
    (services.train_draft_cmd)."""
    seq_prompts, answers = [], []
    if cfg.greedy_answers:
        answers += generate_answers(engine, prompts, cfg.max_tokens, cfg.gen_batch, cfg.answers_cache)
        seq_prompts += prompts
    for r in range(cfg.first_sample_round, cfg.first_sample_round + cfg.sampled_answers):
        answers += generate_answers(engine, prompts, cfg.max_tokens, cfg.gen_batch, cfg.answers_cache,
                                    cfg.sample_temperature, r)
        seq_prompts += prompts
    return seq_prompts, answers


def teacher_features(engine, seqs: list[list[int]], tokens_per_pass: int = 2048):
    """Target hidden states before the final norm at every position of every sequence -> list of [T, D] fp32.
    Several sequences per forward pass, no LM head."""
    from tqdm import tqdm

    feats = []
    with tqdm(total=sum(map(len, seqs)), desc="target features", unit="tok") as bar:
        i = 0
        while i < len(seqs):
            j, n = i, 0
            while j < len(seqs) and (j == i or n + len(seqs[j]) <= tokens_per_pass):
                n += len(seqs[j])
                j += 1
            feats += engine.hidden_states(seqs[i:j])
            bar.update(n)
            i = j
    return feats


def cached_features(engine, seqs: list[list[int]], path: str | None):
    """teacher_features, kept in `path` between runs (keyed by the sequences themselves): only sequences not there
    yet are computed, and the file is rewritten with every sequence of this run."""
    import torch

    known: dict[tuple[int, ...], object] = {}
    if path and os.path.exists(path):
        saved = torch.load(path, weights_only=True)
        known = {tuple(s): f for s, f in zip(saved["seqs"], saved["feats"])}
    todo = [s for s in seqs if tuple(s) not in known]
    if todo:
        print(f"target features of {len(todo)} of {len(seqs)} sequences to compute", flush=True)
        for s, f in zip(todo, teacher_features(engine, todo)):
            known[tuple(s)] = f
        if path:
            torch.save({"seqs": seqs, "feats": [known[tuple(s)] for s in seqs]}, path)
    return [known[tuple(s)] for s in seqs]


def reduced_vocab(seqs: list[list[int]], n: int, vocab: int, always: list[int]):
    import torch

    counts = torch.zeros(vocab, dtype=torch.int64)
    for ids in seqs:
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)
    counts[always] = counts.max() + 1                                            # EOS is always draftable
    return counts.topk(min(n, vocab)).indices.sort().values                      # [N]


def read_prompts(files: str) -> list[str]:
    """The prompts of comma-separated files, one per non-empty line, each once (first occurrence kept)."""
    texts: dict[str, None] = {}
    for path in files.split(","):
        with open(path.strip()) as f:
            texts.update((line.strip(), None) for line in f if line.strip())
    return list(texts)


def coverage(answers: list[list[int]], id_map) -> float:
    keep = set(id_map.tolist())
    total = sum(len(a) for a in answers)
    return sum(1 for a in answers for t in a if t in keep) / max(1, total)
